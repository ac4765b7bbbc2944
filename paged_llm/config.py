"""Engine configuration as data: dataclasses that Hydra composes (``configs/``) and that plain
Python builds through ``LLM(**kwargs)``. Swappable parts (attention backend, KV policy) are a
name, a dotted path or a ``{_target_: ...}`` mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from paged_llm.kv_transfer.config import as_kv_transfer_config
from paged_llm.utils.checks import is_int

CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "NONE")
# vLLM's older ``task=`` names -> the runner each means
_RUNNER_OF_TASK = {"generate": "generate", "embed": "pooling", "encode": "pooling",
                   "classify": "pooling", "score": "pooling", "reward": "pooling"}  # fmt: skip


@dataclass
class ModelConfig:
    """Which model to run and how."""

    model: str = "tiny"  # local Hugging Face checkpoint directory, or a built-in preset name
    tokenizer: str | None = None  # defaults to the model directory
    skip_tokenizer_init: bool = False  # token ids in and out only (no text, no detokenizing)
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: float32 on CPU)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Weights: None | int8 | int4_rtn | int4_gptq | int4_awq | fp8 | gptq | awq (a pre-quantized
    # checkpoint) | {_target_: ...}; see paged_llm/quant/registry.py
    quantization: Any = None
    # vLLM's names. Ranks that split every layer (torch.distributed: gloo on CPU, NCCL on CUDA);
    # see docs/tensor_parallel.md. 1 = one process, no torch.distributed at all.
    tensor_parallel_size: int = 1
    # vLLM's. With tensor_parallel_size > 1, each rank holds whole experts of a mixture-of-
    # experts model (E / N of them) instead of a 1 / N slice of every expert
    enable_expert_parallel: bool = False
    # True: never use CUDA graphs for decode steps (they are only used on CUDA anyway)
    enforce_eager: bool = False
    # vLLM's compilation_config names. FULL: steps with prompt tokens (mixed prefill + decode)
    # replay graphs too, up to max_cudagraph_capture_size tokens; FULL_DECODE_ONLY: decode
    # (and speculative verification) steps only; NONE: like enforce_eager. runner/cuda_graphs.py
    cudagraph_mode: str = "FULL"
    max_cudagraph_capture_size: int = 512
    # vLLM's: allow LLM.sleep / wake_up (free the weights' and KV cache's memory between uses;
    # paged_llm/runner/sleep.py). Costs nothing until sleep() is called.
    enable_sleep_mode: bool = False
    # CPU: linear layers send inputs of at least this many rows to oneDNN's matmul, faster than
    # torch's default (MKL) there; None keeps torch's default. See paged_llm/layers/linear_setup.py
    cpu_onednn_min_rows: int | None = 1
    # Sibling linears (q/k/v, gate/up) as one GEMM over side-by-side weights, where they are
    # plain linears (not quantized, LoRA-wrapped or sharded); paged_llm/layers/linear.py
    merge_sibling_linears: bool = True
    # vLLM's. Where default sampling settings and extra EOS ids come from: "auto" (the model's
    # generation_config.json), "vllm" (paged-llm's own sampling defaults) or a directory; see
    # paged_llm/engine/generation_config.py. The override dict is laid over it.
    generation_config: str = "auto"
    override_generation_config: Any = None  # e.g. {"temperature": 0.5}
    # vLLM's. "generate" (tokens) or "pooling" (embeddings: LLM.embed / LLM.encode, the
    # server's /v1/embeddings; sequence classifiers: LLM.classify / LLM.score); vLLM's older
    # task="embed" / "classify" / "score" / "reward" mean runner="pooling". pooler_config:
    # {"pooling_type": LAST | MEAN | CLS | ALL, "normalize": bool}, else the checkpoint's
    # sentence-transformers files, else LAST, normalised; see paged_llm/pooling/
    runner: str = "generate"
    task: str | None = None
    pooler_config: Any = None
    # vLLM's. deepseek_r1 | qwen3: the model thinks in <think> ... </think>; structured outputs
    # constrain only what follows, and the server returns the thought as "reasoning"
    # (paged_llm/engine/reasoning.py)
    reasoning_parser: str | None = None
    # Architectures from outside the package: {"MyForCausalLM": "my_pkg.models.MyForCausalLM"},
    # registered before loading (as ModelRegistry.register_model does; docs/models.md)
    model_classes: dict[str, str] | None = None

    def __post_init__(self) -> None:
        _check_optional_count("max_model_len", self.max_model_len)
        if self.model_classes is not None:
            from paged_llm.utils.registry import check_import_path

            if not isinstance(self.model_classes, Mapping):
                raise ValueError(f"model_classes must map architecture names to import paths, "
                                 f"got {self.model_classes!r}")  # fmt: skip
            self.model_classes = {str(k): check_import_path(str(v))
                                  for k, v in self.model_classes.items()}  # fmt: skip
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"unknown cudagraph_mode {self.cudagraph_mode!r}; choose one of "
                             f"{list(CUDAGRAPH_MODES)}")  # fmt: skip
        _check_optional_count("max_cudagraph_capture_size", self.max_cudagraph_capture_size)
        if self.task is not None and self.task not in _RUNNER_OF_TASK:
            raise ValueError(f"unknown task '{self.task}'; choose one of {list(_RUNNER_OF_TASK)}")
        if self.reasoning_parser is not None:
            from paged_llm.engine.reasoning import reasoning_parser

            reasoning_parser(self.reasoning_parser)  # a typo fails here, before loading
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"unknown runner '{self.runner}'; choose generate or pooling")
        if self.task is not None:  # runner's default is generate: only pooling can disagree
            if self.runner == "pooling" and self.task == "generate":
                raise ValueError(f"task='{self.task}' contradicts runner='{self.runner}'")
            self.runner = _RUNNER_OF_TASK[self.task]


def _check_optional_count(name: str, value: Any) -> None:
    """None (the default) or an integer >= 1; 0 is not taken as "default" silently."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")


@dataclass
class CacheConfig:
    """Size and layout of the paged KV cache."""

    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + KV
    cpu_kv_cache_gib: float = 1.0  # CPU: bytes for the KV pool (vLLM's VLLM_CPU_KVCACHE_SPACE)
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = False
    # vLLM's: GiB of CPU memory for a second prefix-cache tier: cached blocks evicted from the
    # device are copied there and copied back on a later hit (core/kv/offload.py); 0: off
    kv_offloading_size: float = 0.0

    def __post_init__(self) -> None:
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {b!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("cpu_kv_cache_gib", "swap_space", "kv_offloading_size"):
            if not getattr(self, name) >= 0:  # NaN fails too
                raise ValueError(f"{name} must be >= 0 GiB, got {getattr(self, name)}")


@dataclass
class SchedulerConfig:
    """Batching limits and the KV allocation policy."""

    policy: Any = "paged"  # paged | orca_max | orca_pow2 | orca_oracle | static | {_target_: ...}
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(max_model_len, 2048)
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"  # recompute | swap
    # vLLM's: fcfs | priority (requests' ``priority``: smaller runs sooner; core/queue_policy.py)
    scheduling_policy: str = "fcfs"
    # Make step N's outputs (logprobs, text, RequestOutputs) while the device runs step N + 1's
    # forward; each step() then returns the previous step's outputs (vLLM's async output
    # processing; its flag ``disable_async_output_proc`` is accepted too). Tokens are the same.
    async_output_proc: bool = False
    # vLLM's async scheduling: plan and launch step N + 1 while the device runs step N; its
    # sampled ids feed N + 1's inputs on the device and reach the host a step later (also
    # making N's outputs then). Tokens are the same; a step that samples with logits
    # processing or a grammar waits for its tokens (docs/architecture.md)
    async_scheduling: bool = False

    def token_budget(self, max_model_len: int) -> int:
        """Tokens one step may schedule: max_num_batched_tokens, else max(max_model_len, 2048)."""
        return self.max_num_batched_tokens or max(max_model_len, 2048)

    def __post_init__(self) -> None:
        _check_optional_count("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("async_output_proc", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names); see docs/lora.md."""

    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one batch (device slots)
    max_lora_rank: int = 16  # the largest adapter rank accepted (slots are this wide)
    max_cpu_loras: int | None = None  # adapters kept in CPU memory (default: max_loras)

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        _check_optional_count("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )


@dataclass
class EngineConfig:
    """Everything an LLMEngine needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    attention_backend: Any = "auto"  # auto | torch | cpu | triton | contiguous | {_target_: ...}
    # vLLM's speculative_config: {"method": "ngram" | "draft_model" | "eagle",
    # "num_speculative_tokens": k, "model": draft or EAGLE head checkpoint dir,
    # "prompt_lookup_max": n, ...}; None disables speculation
    speculative_config: dict[str, Any] | None = None
    # vLLM's kv_transfer_config: {"kv_connector": "SharedStorageConnector", "kv_role":
    # "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}} or a
    # KVTransferConfig; None: no KV moves between engines (docs/kv_transfer.md)
    kv_transfer_config: Any = None
    log_stats: bool = False
    # Extra engine plug-ins (engine/core.py), each a dotted path or {_target_: ..., args};
    # built with ``engine=`` the LLMEngine, after the built-in ones, and called in this order
    plugins: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv_transfer_config = as_kv_transfer_config(self.kv_transfer_config)
        self.check_async_scheduling()

    def check_async_scheduling(self) -> None:
        """Refuse what async scheduling cannot feed from the device: drafts are proposed from
        the tokens on the host, and other tensor-parallel ranks have no sampled ids."""
        if not self.scheduler.async_scheduling:
            return
        if self.speculative_config:
            raise ValueError("async_scheduling cannot be combined with speculative decoding")
        if self.model.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size=1")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-style flat keyword arguments (``LLM(model=..., block_size=...)``)."""
        cfg = cls()
        sections = {"model": cfg.model, "cache": cfg.cache, "scheduler": cfg.scheduler,
                    "lora": cfg.lora}  # fmt: skip
        owner = {f.name: name for name, sec in sections.items() for f in fields(sec)}
        changes: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in kwargs.items():
            if key in ("attention_backend", "log_stats", "speculative_config", "plugins"):
                setattr(cfg, key, value)
            elif key == "disable_log_stats":  # vLLM's name, inverted
                cfg.log_stats = not value
            elif key == "disable_async_output_proc":  # vLLM's name, inverted
                changes["scheduler"]["async_output_proc"] = not value
            elif key == "kv_transfer_config":
                cfg.kv_transfer_config = as_kv_transfer_config(value)
            elif key in owner:
                changes[owner[key]][key] = value
            else:
                raise ValueError(f"unknown engine argument '{key}'")
        for name, section in sections.items():  # replace() re-runs each section's checks
            setattr(cfg, name, replace(section, **changes[name]))
        cfg.check_async_scheduling()
        return cfg


class EngineArgs:
    """vLLM's ``EngineArgs``: the keyword arguments ``LLM(...)`` takes, for
    ``LLMEngine.from_engine_args``. They are checked here, so a typo fails at once."""

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        self.model, self.kwargs = model, kwargs
        self.create_engine_config()

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig these arguments describe."""
        return EngineConfig.from_kwargs(model=self.model, **self.kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {"model": self.model, **self.kwargs}.items())
        return f"EngineArgs({args})"


def engine_config_from_dict(cfg: dict[str, Any]) -> EngineConfig:
    """Build an EngineConfig from a resolved Hydra config (the groups of
    configs/engine_groups.yaml); unknown keys raise, so typos in overrides are caught."""
    sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                "lora": LoRAConfig}  # fmt: skip
    for name, cls in sections.items():
        unknown = set(cfg.get(name) or {}) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {name} option(s) {sorted(unknown)}")
    from paged_llm.config_groups import quant_spec, speculative_spec

    quant = {"quantization": quant_spec(cfg.get("quant"))}  # the quant group; model.* may set it
    return EngineConfig(
        model=ModelConfig(**{**quant, **cfg["model"]}),
        cache=CacheConfig(**cfg["cache"]),
        scheduler=SchedulerConfig(policy=cfg.get("policy", "paged"), **cfg["scheduler"]),
        lora=LoRAConfig(**(cfg.get("lora") or {})),
        attention_backend=cfg.get("attention", "auto"),
        speculative_config=speculative_spec(cfg.get("speculative")),
        kv_transfer_config=cfg.get("kv_transfer") or None,
        plugins=list(cfg.get("plugins") or []),
    )
