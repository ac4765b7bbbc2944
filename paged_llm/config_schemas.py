"""Typed schemas of the Hydra configs, registered in Hydra's ConfigStore under ``schema/``: a
config file that lists one in its defaults (``- /schema/cache@_here_``) is checked against it
when composed, so a wrong type (``scheduler.max_num_seqs=abc``) or an unknown key fails before
any job of a run or a sweep starts, naming the key's path. Registered on import of ``paged_llm``
(the package's ``__init__``), so every entry point and ``paper_repro.common.compose`` has them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


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


@dataclass
class WorkloadSchema:
    """configs/workload/*.yaml: paged_llm.workloads.arrivals.WorkloadSpec's fields, typed."""

    name: str = "sharegpt"
    path: str | None = None
    synthetic: str = "sharegpt"
    tokenizer: str | None = None
    request_rate: float = 1.0
    duration_s: float | None = 600.0
    num_requests: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    max_total_len: int = 2048
    min_input_len: int = 1
    min_output_len: int = 1
    length_scale: float = 1.0
    n: int = 1
    beam_width: int = 1
    beam_parents: str = "uniform"
    prefix_len: int = 0
    chat_turns: float = 0.0
    max_prompt_len: int | None = None
    max_output_len: int | None = None
    turns: int = 0
    think_time_s: float = 30.0


@dataclass
class ServingEngineSchema:
    """paper_base.yaml's ``engine``: paged_llm.sim.settings.ServingSettings, typed."""

    block_size: int = 16
    max_num_batched_tokens: int = 2560
    max_num_seqs: int = 256
    max_model_len: int = 2048
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space_gib: float = 20.0
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    kv_offloading_size: float = 0.0
    scheduling_policy: str = "fcfs"
    free_blocks_behind_window: bool = True


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
    device: str = "cpu"
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
