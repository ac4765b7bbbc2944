"""What the scheduler gives each step (plain Python, no torch): the ``SchedulerOutput`` that
tells the model runner what to compute and which blocks to move, and the step's telemetry. Its
limits are core/scheduler_limits.py's (re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_llm.core.kv.stats import MemoryBreakdown
from paged_llm.core.request import Request
from paged_llm.core.scheduler_limits import SchedulerLimits

__all__ = ["IterationStats", "ScheduledRequest", "SchedulerLimits", "SchedulerOutput"]


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int
    block_table: list[int]
    num_lookahead: int = 0  # slots allocated beyond num_new_tokens for draft tokens

    @property
    def samples(self) -> bool:
        """True when this step completes the request's known tokens, so it samples one more
        (never for a pooling request: it pools instead)."""
        r = self.request
        return not r.is_pooling and r.num_computed_tokens + self.num_new_tokens >= r.num_tokens


@dataclass
class IterationStats:
    """Telemetry of one step, for logs and experiments."""

    now: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_batched_tokens: int
    kv_usage: float
    num_preemptions: int
    swap_in_blocks: int
    swap_out_blocks: int
    memory: MemoryBreakdown | None = None


@dataclass
class SchedulerOutput:
    """What the model runner must do this step."""

    scheduled: list[ScheduledRequest]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # all block moves above, in the order the runner must apply them (see take_block_ops)
    block_ops: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    stats: IterationStats | None = None

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when no request runs and no blocks move."""
        return not (self.scheduled or self.swap_in or self.swap_out or self.copy_blocks)
