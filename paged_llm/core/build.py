"""The one place a scheduler is assembled: a KV policy over its pool, under batch limits. The
engine and the simulators (sim/executor.py, sim/disagg.py) all build theirs here, so a policy
behaves the same in a real and a simulated run. Plain Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_llm.core.kv import POLICIES
from paged_llm.core.scheduler import Scheduler, SchedulerLimits
from paged_llm.utils.registry import UnsupportedOptions, build


@dataclass(frozen=True)
class KVPool:
    """What a KV policy manages: its blocks, their size, and the optional tiers and features."""

    num_blocks: int
    block_size: int
    max_model_len: int
    num_cpu_blocks: int = 0  # swap space
    num_offload_blocks: int = 0  # the prefix cache's CPU tier
    enable_prefix_caching: bool = False
    sliding_window: int | None = None  # free each sequence's blocks behind this window
    kv_connector: Any = None  # a KV connector's scheduler side (disaggregated prefill)


# What each optional pool argument asks of a policy, for the error when it cannot.
FEATURES = {
    "enable_prefix_caching": "cache prefixes",
    "sliding_window": "free blocks behind a sliding window",
    "offload_blocks": "keep a CPU tier for the prefix cache",
    "kv_connector": "transfer KV through a connector",
}


def build_scheduler(
    policy: Any, pool: KVPool, limits: SchedulerLimits, track_memory: bool = False
) -> Scheduler:
    """The Scheduler over ``policy``'s KV manager (a name from POLICIES, a dotted path or a
    ``{_target_: ...}`` mapping) of ``pool``; a policy that cannot take a feature the pool asks
    for (prefix caching, an offload tier) is refused naming both."""
    extra: dict[str, Any] = {}
    if pool.enable_prefix_caching:
        extra["enable_prefix_caching"] = True
    if pool.sliding_window is not None:
        extra["sliding_window"] = pool.sliding_window
    if pool.num_offload_blocks:
        extra["offload_blocks"] = pool.num_offload_blocks
    if pool.kv_connector is not None:
        extra["kv_connector"] = pool.kv_connector
    try:
        kv = build(
            "policy", policy, POLICIES, num_blocks=pool.num_blocks, block_size=pool.block_size,
            max_model_len=pool.max_model_len, num_cpu_blocks=pool.num_cpu_blocks, **extra,
        )  # fmt: skip
    except UnsupportedOptions as err:
        if not extra:
            raise
        asked = " or ".join(FEATURES[k] for k in extra)
        raise ValueError(f"policy {policy!r} cannot {asked}: {err}") from err
    return Scheduler(kv, limits, track_memory=track_memory)
