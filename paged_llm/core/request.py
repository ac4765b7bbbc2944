"""A request's bookkeeping state (plain Python, no torch).

One counter, ``num_computed_tokens``, catches up to ``num_tokens`` every step: that single
mechanism expresses prefill, chunked prefill, decode and re-prefill after preemption.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.stop_conditions import OutputConstraint, StopCondition
from paged_llm.sampling_params import SamplingParams

# Async scheduling: an output token that is sampled but still on the device. The scheduler
# plans the next step as if it were known (the runner feeds the real id from the device) and
# ``Scheduler.resolve_placeholders`` writes it in once it reaches the host.
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """True for the three terminal states."""
        return self._value_ in ("stop", "length", "abort")  # _value_: no descriptor, per step


@dataclass(eq=False)  # identity semantics: requests are compared and hashed by object
class Request:
    """One sequence to generate: prompt, outputs so far, and scheduling counters."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # priority scheduling: smaller runs sooner (vLLM's)
    lora_int_id: int = 0  # the LoRA adapter it runs with (LoRARequest.lora_int_id); 0 = none
    eos_token_id: int | None = None
    max_model_len: int = 2048
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # sequences of one group (parallel samples, beams) share blocks and are preempted together
    group_id: str | None = None
    # speculative decoding: draft tokens to verify in this step (not yet part of the output)
    spec_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    # timestamps on the engine's clock (wall clock in real runs, simulated time otherwise)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at (latest) admission
    # SamplingParams.bad_words as token sequences (the engine tokenizes them on arrival)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # structured output: the sequence's grammar state; it sees every appended token and ends
    # the request once complete (core/stop_conditions.py)
    guide: OutputConstraint | None = None
    # stop strings: asked after each appended token for the stop string it completed
    stop_strings: StopCondition | None = None
    # finished by EOS or one of stop_token_ids: as in vLLM, that token's text is left out of
    # the output text (unless include_stop_str_in_output), though its id stays in the output
    stopped_by_token: bool = False
    # a pooling request (PoolingParams; opaque here) generates nothing: it finishes once its
    # prompt has run. pool_all_tokens: its pooling reads every prompt position's hidden state
    pooling_params: Any = None
    pool_all_tokens: bool = False
    # async scheduling: its last output token is a placeholder that reaches max_output_tokens,
    # so nothing more may run; the real token finishes it (by length, or a stop string)
    final_token_pending: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt is empty")
        if self.is_pooling and len(self.prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"request {self.request_id}: prompt has {len(self.prompt_token_ids)} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
        if not self.is_pooling and len(self.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {self.request_id}: prompt has {len(self.prompt_token_ids)} tokens, "
                f"which leaves no room to generate within max_model_len={self.max_model_len}"
            )

    @property
    def is_pooling(self) -> bool:
        """True for a pooling (embedding) request: it runs its prompt and nothing more."""
        return self.pooling_params is not None

    @property
    def may_use_cached_prefix(self) -> bool:
        """False when every prompt token must run (its logprobs were asked for, or its pooling
        reads every position), as in vLLM."""
        return self.sampling_params.prompt_logprobs is None and not self.pool_all_tokens

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (what the KV cache must eventually hold)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_output_tokens(self) -> int:
        """The most tokens this request may generate (max_tokens, capped by max_model_len)."""
        if self.is_pooling:
            return 0
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it can generate: the true final length with ignore_eos."""
        return self.num_prompt_tokens + self.max_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens ``start`` to ``end`` (exclusive) of the prompt, then the outputs, then the
        drafts: a step's query tokens, without joining the whole sequence each step."""
        out: list[int] = []
        for part in (self.prompt_token_ids, self.output_token_ids, self.spec_token_ids):
            if start < len(part) and end > 0:
                out += part[max(start, 0) : end]
            start, end = start - len(part), end - len(part)
            if end <= 0:
                break
        return out

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal state."""
        return self.status.finished

    def append_token(self, token_id: int, now: float) -> None:
        """Record one generated token and its time."""
        self.output_token_ids.append(token_id)
        if self.guide is not None:  # in step with the output, so check_stop sees this token's
            self.guide.accept(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    def check_stop(self) -> RequestStatus | None:
        """Return the finished status implied by the last token, or None to continue."""
        status = self._token_stop()
        # a stop string wins over length; a stop token's own text is not searched (vLLM drops
        # that text from the output, see stopped_by_token)
        if self.stop_strings is not None and not self.stopped_by_token:
            stop = self.stop_strings(self.output_token_ids)
            if stop is not None:
                self.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        return status

    def _token_stop(self) -> RequestStatus | None:
        """The finish the last token's id implies (length, grammar, EOS, stop_token_ids)."""
        params = self.sampling_params
        n_out = self.num_output_tokens
        if n_out >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.guide is not None and self.guide.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # nothing can follow, min_tokens or not
        if n_out < params.min_tokens:
            return None
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last == self.eos_token_id:
            self.stopped_by_token = True
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_reason = last
            self.stopped_by_token = True
            return RequestStatus.FINISHED_STOPPED
        return None
