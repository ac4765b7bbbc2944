"""Typed schemas of the Hydra configs, registered in Hydra's ConfigStore under ``schema/``: a
config file that lists one in its defaults (``- /schema/cache@_here_``) is checked against it
when composed, so a wrong type (``scheduler.max_num_seqs=abc``) or an unknown key fails before
any job of a run or a sweep starts, naming the key's path. Registered by the Hydra plugin
module ``hydra_plugins/paged_llm_configs`` (Hydra imports it before composing any config), so
every entry point and ``paper_repro.common.compose`` has them."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import WorkloadSpec


@dataclass
class CacheSchema:
    """configs/cache/*.yaml: the paged KV cache (paged_llm.config.CacheConfig)."""

    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 0.25
    swap_space: float = 1.0
    enable_prefix_caching: bool = False
    kv_cache_dtype: str = "auto"  # written by the kv_cache_dtype group


@dataclass
class SchedulerSchema:
    """configs/scheduler/*.yaml: batching limits (paged_llm.config.SchedulerConfig)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"
    async_output_proc: bool = False
    async_scheduling: bool = False
    scheduling_policy: str = "fcfs"  # written by the scheduling group


def typed_copy(cls: type, name: str, doc: str) -> type:
    """A mutable dataclass with ``cls``'s fields, types and defaults (OmegaConf marks a frozen
    dataclass's node read-only, so the frozen originals cannot be schemas themselves)."""
    hints = typing.get_type_hints(cls)
    copied = []
    for f in dataclasses.fields(cls):
        default = (
            dataclasses.field(default_factory=f.default_factory)
            if f.default_factory is not dataclasses.MISSING
            else dataclasses.field(default=f.default)
        )
        copied.append((f.name, hints[f.name], default))
    schema = dataclasses.make_dataclass(name, copied)
    schema.__module__, schema.__doc__ = __name__, doc
    return schema


WorkloadSchema = typed_copy(
    WorkloadSpec, "WorkloadSchema", "configs/workload/*.yaml: WorkloadSpec's fields, typed."
)
ServingEngineSchema = typed_copy(
    ServingSettings, "ServingEngineSchema", "paper_base.yaml's ``engine``: ServingSettings, typed."
)


@dataclass
class ThroughputWorkloadSchema:
    """throughput.yaml's ``workload``: a length trace or synthetic lengths."""

    path: str | None = None
    filter_total_below: int = 2048
    synthetic: str = "sharegpt"
    max_total: int = 256


@dataclass
class ThroughputSchema:
    """throughput.yaml's own keys (the engine groups are typed by their own schemas)."""

    num_requests: int = 64
    seed: int = 0
    dtype: str = "float32"
    engine_device: str = "cpu"
    num_threads: int | None = None
    baselines: list[str] = field(default_factory=lambda: ["generate", "generate_batch"])
    sweep_baselines: bool = False
    repeats: int = 1
    warmup_requests: int = 2
    warmup_max_tokens: int = 8
    save_outputs: bool = False
    workload: ThroughputWorkloadSchema = field(default_factory=ThroughputWorkloadSchema)
    # the groups and the engine.* / baselines' sections: typed elsewhere or free-form
    model: Any = None
    attention: Any = None
    policy: Any = None
    quant: Any = None
    speculative: Any = None
    kv_cache_dtype: Any = None
    scheduling: Any = None
    cache: Any = None
    scheduler: Any = None
    logger: Any = None
    engine: Any = None
    generate: Any = None
    generate_batch: Any = None


SCHEMAS: dict[str, type] = {
    "cache": CacheSchema,
    "scheduler": SchedulerSchema,
    "workload": WorkloadSchema,
    "serving_engine": ServingEngineSchema,
    "throughput": ThroughputSchema,
}


def register() -> None:
    """Store every schema as ``schema/<name>`` in Hydra's ConfigStore."""
    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(group="schema", name=name, node=node)


register()
