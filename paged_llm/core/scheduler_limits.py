"""What the scheduler takes (plain Python, no torch): its batch limits and modes, checked when
they are made, before any request runs."""

from __future__ import annotations

from dataclasses import dataclass

from paged_llm.core.preemption import PREEMPTION_MODES
from paged_llm.core.queue_policy import queue_policy_class


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
        if self.preemption_mode not in PREEMPTION_MODES:
            modes = " or ".join(repr(m) for m in PREEMPTION_MODES)
            raise ValueError(f"preemption_mode must be {modes}, got '{self.preemption_mode}'")
        queue_policy_class(self.scheduling_policy)  # raises naming the choices
