"""What the scheduler takes (plain Python, no torch): its batch limits and modes, checked when
they are made, and against its KV manager when the scheduler is built, before any request
runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_llm.core.preemption import PREEMPTION_MODES
from paged_llm.core.queue_policy import queue_policy_class

if TYPE_CHECKING:
    from paged_llm.core.kv.base import KVCacheManager


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


def bind_limits(kv: KVCacheManager, limits: SchedulerLimits) -> None:
    """Refuse limits that ``kv`` cannot serve (ValueError naming the fix), and tell it the most
    tokens one request computes in a step."""
    if limits.preemption_mode == "swap" and not kv.supports_swap:
        raise ValueError(f"policy '{kv.name}' does not support preemption_mode=swap")
    if not limits.enable_chunked_prefill and limits.max_num_batched_tokens < kv.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({limits.max_num_batched_tokens}) is smaller than "
            f"max_model_len ({kv.max_model_len}); enable chunked prefill or raise it"
        )
    # Chunked prefill bounds what one request computes per step (a decode: 1 + lookahead),
    # which lets a sliding-window policy hold less than a request's whole length.
    step = max(limits.max_num_batched_tokens, 1 + limits.num_lookahead_slots)
    kv.bound_step_tokens(step if limits.enable_chunked_prefill else None)
    if kv.blocks_at_most(kv.max_model_len) > kv.num_blocks:
        raise ValueError(
            f"the KV pool holds {kv.num_slots} tokens, fewer than max_model_len "
            f"({kv.max_model_len}) needs; enlarge the cache or lower max_model_len"
        )
    # A reservation is one buddy run, which may be smaller than the pool.
    if kv.max_request_slots < kv.blocks_at_most(kv.max_model_len) * kv.block_size:
        raise ValueError(
            f"policy '{kv.name}' reserves one power-of-two run of blocks per request, and "
            f"the largest run of this {kv.num_blocks}-block pool holds "
            f"{kv.max_request_slots} tokens, fewer than max_model_len ({kv.max_model_len}); "
            "use a power-of-two number of blocks, enlarge the cache or lower max_model_len"
        )
