"""A user request as the engine tracks it beside the scheduler: one sequence, or the n
parallel samples of one prompt, with what its outputs need (text, logprobs, stream cursor)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.request import Request
from paged_llm.engine.deltas import DeltaCursor
from paged_llm.engine.output_processor import IncrementalDetokenizer
from paged_llm.engine.stop_strings import StopStringChecker
from paged_llm.lora.request import LoRARequest
from paged_llm.outputs import LogprobEntry


@dataclass
class Tracked:
    """Engine-side state of one sequence that the scheduler does not need."""

    request: Request
    prompt: str | None
    text: str = ""
    logprobs: list[LogprobEntry] | None = None
    cumulative_logprob: float = 0.0
    num_scored: int = 0  # output tokens whose logprobs have been recorded
    sent: DeltaCursor = field(default_factory=DeltaCursor)  # RequestOutputKind.DELTA's progress
    finish_sent: bool = False  # DELTA: its finish reason has been reported
    detokenizer: IncrementalDetokenizer | None = None  # None: no text (no tokenizer or asked)
    stop_strings: StopStringChecker | None = None  # with SamplingParams.stop (also on its Request)


@dataclass
class RequestGroup:
    """A user request: one sequence, or n parallel samples of one prompt."""

    request_id: str
    members: list[Tracked]
    unforked: list[Tracked]  # samples waiting to share the first member's prompt blocks
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (and
    # for tokens whose chunk has not run yet)
    prompt_logprobs: list[LogprobEntry | None] | None = None
    reported: bool = False  # an output was returned (DELTA sends prompt logprobs once)
    lora_request: LoRARequest | None = None
    pooled: Any = None  # a pooling request's output tensor, once its prompt has run
