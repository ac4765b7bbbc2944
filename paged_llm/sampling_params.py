"""SamplingParams with vLLM's names and defaults; validated on construction."""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# vLLM keeps these here; they live beside the constraint's other code
from paged_llm.structured_output_params import GuidedDecodingParams, StructuredOutputsParams

GREEDY_BELOW_TEMPERATURE = 1e-5


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step()`` returns for a running request (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output (for streaming)
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's output (temperature 0 means greedy)."""

    n: int = 1
    # sample best_of sequences, return the n with the highest cumulative logprob (vLLM V0's
    # best_of; None means n)
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables top-k
    min_p: float = 0.0
    # OpenAI's penalties on tokens already in the output (count and presence), in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # > 1 discourages, < 1 encourages every token of the prompt and the output (CTRL's form)
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never complete one of these (needs a tokenizer)
    guided_decoding: GuidedDecodingParams | None = None  # structured output (needs xgrammar)
    # vLLM's current name for the same thing (its older guided_decoding was removed in v0.12);
    # either may be given, and both then hold the same object
    structured_outputs: StructuredOutputsParams | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (plus the sampled)
    prompt_logprobs: int | None = None  # the same for each prompt token (raw model logprobs)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: spaces around special tokens in the text; only slow (Python) tokenizers use it,
    # fast ones (every tokenizer this project builds) decode the same either way
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's)
    # vLLM's user logits processors, applied first, per sequence: fn(output_ids, logits) or
    # fn(prompt_ids, output_ids, logits), logits a [vocab] float32 row; returns the new row
    logits_processors: list[Callable[..., Any]] | None = None
    detokenize: bool = True  # False: leave the output text empty (token ids only)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None  # vLLM's: free-form data for your own processors

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.logits_processors = list(self.logits_processors) if self.logits_processors else None
        if self.best_of is None:
            self.best_of = self.n
        both = self.structured_outputs is not None and self.guided_decoding is not None
        if both and self.structured_outputs is not self.guided_decoding:
            raise ValueError("give structured_outputs or guided_decoding, not both")
        self.guided_decoding = self.structured_outputs = (
            self.guided_decoding or self.structured_outputs
        )
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field (sampling_params_checks.py)."""
        from paged_llm.sampling_params_checks import check_sampling_params  # it reads our types

        check_sampling_params(self)

    def clone(self) -> SamplingParams:
        """A deep copy that shares the logits processors (vLLM's: they may hold large state;
        a processor with its own ``clone()`` is cloned)."""
        processors = self.logits_processors or []
        memo = {id(fn): fn.clone() if hasattr(fn, "clone") else fn for fn in processors}
        return copy.deepcopy(self, memo)

    @property
    def tracks_logprobs(self) -> bool:
        """True when each sampled token's logprob is needed: asked for, or to rank best_of."""
        return self.logprobs is not None or self.best_of > self.n

    @property
    def has_penalties(self) -> bool:
        """True when the output history changes the logits (any of the three penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def needs_logits_processing(self, num_output_tokens: int) -> bool:
        """Whether ``runner.logits_processors.process_logits`` would change a row after
        ``num_output_tokens`` outputs (cheap, and asked here, so that most requests, which it
        would leave alone, never enter that module)."""
        return (
            num_output_tokens < self.min_tokens
            or bool(self.logits_processors)
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.has_penalties
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax decoding: temperature 0, or so close to it that logits
        divided by it would overflow (vLLM's threshold)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE
