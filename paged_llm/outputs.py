"""Result objects with vLLM's names (RequestOutput, CompletionOutput, Logprob)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class Logprob(float):
    """One token's log-probability, with vLLM's ``Logprob`` attributes: ``.logprob``,
    ``.rank`` (1 = the most likely token) and ``.decoded_token`` (its text, when the model has
    a tokenizer).

    It is also the float itself, so code written for vLLM (``entry[t].logprob``) and code
    that treats an entry as a number (``sum(entry[t] for ...)``) both work.
    """

    rank: int | None
    decoded_token: str | None

    def __new__(
        cls, logprob: float, rank: int | None = None, decoded_token: str | None = None
    ) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        """The log-probability as a plain float."""
        return float(self)

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # a pickled copy (multiprocessing) keeps the fields
        return (Logprob, (float(self), self.rank, self.decoded_token))


# One generated (or prompt) position: token id -> Logprob, for the chosen token and the top-k.
LogprobEntry = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # logprobs[i] maps token id -> Logprob for generated position i (sampled token + top-k)
    logprobs: list[LogprobEntry] | None = None
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
    # when each output token was sampled: in the finished request's output only (a copy in
    # every running output would cost O(output length) per request per step)
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
    # SamplingParams.prompt_logprobs: per prompt token, token id -> Logprob (it + top-k); the
    # first token has none (None), as in vLLM
    prompt_logprobs: list[LogprobEntry | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's field)
    lora_request: Any = None  # the LoRARequest it ran with (vLLM's field); None: the base model


@dataclass
class PoolingOutput:
    """A pooling request's result: ``data`` [H] (or [L, H] per token), float32 on the CPU."""

    data: Any  # torch.Tensor; typed Any so this module imports without torch


@dataclass
class PoolingRequestOutput:
    """The result of one ``LLM.encode`` / pooling request (vLLM's names)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    lora_request: Any = None
    metrics: RequestMetrics | None = None  # arrival, scheduling and finish times


@dataclass
class EmbeddingOutput:
    """One embedding as a list of floats (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """Its length."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """The result of one ``LLM.embed`` request (vLLM's names): a pooling output whose
    ``outputs`` is the embedding as a list of floats."""

    outputs: EmbeddingOutput  # type: ignore[assignment]

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        """The embedding view of a pooling output whose data is one vector."""
        data = output.outputs.data
        if data.dim() != 1:
            raise ValueError(f"an embedding is one vector, got pooled data of shape {data.shape}")
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        return cls(**{**fields, "outputs": EmbeddingOutput(data.tolist())})


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's ``ClassificationOutput``; the raw logits when
    the request turned the activation off)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """Number of labels."""
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """The result of one ``LLM.classify`` request (vLLM's names)."""

    outputs: ClassificationOutput  # type: ignore[assignment]

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        """The classification view of a classifier's pooling output (one score per label)."""
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        return cls(**{**fields, "outputs": ClassificationOutput(output.outputs.data.tolist())})


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``): the cosine similarity of its embeddings,
    or a cross-encoder's relevance probability."""

    score: float


@dataclass
class ScoringRequestOutput:
    """The result of one ``LLM.score`` pair (vLLM's names)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the two prompts' ids, first then second
    finished: bool = True
