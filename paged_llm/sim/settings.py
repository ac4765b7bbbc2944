"""Engine settings shared by real and simulated runs, and the scheduler built from them
(plain Python, no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from paged_llm.core.build import KVPool
from paged_llm.core.build import build_scheduler as build_pool_scheduler
from paged_llm.core.scheduler import Scheduler, SchedulerLimits


@dataclass(frozen=True)
class ServingSettings:
    """vLLM's engine arguments that decide what a step can batch (defaults: the artifact's)."""

    block_size: int = 16
    max_num_batched_tokens: int = 2560
    max_num_seqs: int = 256
    max_model_len: int = 2048
    num_gpu_blocks: int | None = None  # None: what fits the memory (simulated) / profiling (real)
    gpu_memory_utilization: float = 0.9
    swap_space_gib: float = 20.0
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False  # sharing policies only (paged)
    # vLLM's: GiB of CPU memory for a second prefix-cache tier (evicted blocks are copied
    # there and back on a hit; core/kv/offload.py); 0: off
    kv_offloading_size: float = 0.0
    scheduling_policy: str = "fcfs"  # or "priority" (TimedRequest.priority: smaller first)
    # a windowed model: the paged policy frees each sequence's blocks behind the window (the
    # engine's behaviour); False keeps them, to measure what freeing buys
    free_blocks_behind_window: bool = True

    def with_overrides(self, **kw: Any) -> ServingSettings:
        """A copy with some settings changed (e.g. a policy's own max_num_seqs)."""
        return replace(self, **kw) if kw else self

    def limits(self) -> SchedulerLimits:
        """The scheduler's batch limits."""
        return SchedulerLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for result files."""
        return asdict(self)


def build_scheduler(
    policy: Any,
    settings: ServingSettings,
    num_blocks: int,
    num_cpu_blocks: int = 0,
    track_memory: bool = False,
    sliding_window: int | None = None,
    num_offload_blocks: int = 0,
    kv_connector: Any = None,
) -> Scheduler:
    """The real Scheduler (core/build.py, as the engine builds it) over the policy's KV manager
    at these settings; ``sliding_window``: the model's, if every layer has one."""
    pool = KVPool(
        num_blocks, settings.block_size, settings.max_model_len, num_cpu_blocks,
        num_offload_blocks, settings.enable_prefix_caching,
        sliding_window if settings.free_blocks_behind_window else None, kv_connector,
    )  # fmt: skip
    return build_pool_scheduler(policy, pool, settings.limits(), track_memory=track_memory)
