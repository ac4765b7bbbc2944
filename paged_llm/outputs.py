"""Result objects with vLLM's names (RequestOutput, CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # logprobs[i] maps token id -> logprob for generated position i (sampled token + top-k)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (seconds, engine clock) for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end of generate)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: per prompt token, token id -> logprob (it + top-k); the
    # first token has none (None), as in vLLM
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's field)
