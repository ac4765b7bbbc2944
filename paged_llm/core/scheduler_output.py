"""What the scheduler takes and gives each step (plain Python, no torch): its limits, and
the ``SchedulerOutput`` that tells the model runner what to compute and which blocks to move."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_llm.core.kv.stats import MemoryBreakdown
from paged_llm.core.queue_policy import queue_policy_class
from paged_llm.core.request import Request


@dataclass(frozen=True)
class SchedulerLimits:
    """Batch limits of the scheduler (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"  # "recompute" or "swap"
    # speculative decoding: slots reserved after each decode for draft tokens to verify
    num_lookahead_slots: int = 0
    # ... but none in a step that starts with at least this many running requests, where
    # verifying k + 1 positions costs nearly k + 1 decodes (vLLM's disable_by_batch_size)
    spec_disable_batch_size: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs", "priority" or a QueuePolicy's dotted path
    # multi-LoRA: at most this many distinct adapters among running requests (0 = no limit)
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        from paged_llm.core.preemption import PREEMPTION_MODES  # it imports this module

        if self.preemption_mode not in PREEMPTION_MODES:
            modes = " or ".join(repr(m) for m in PREEMPTION_MODES)
            raise ValueError(f"preemption_mode must be {modes}, got '{self.preemption_mode}'")
        queue_policy_class(self.scheduling_policy)  # raises naming the choices


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
