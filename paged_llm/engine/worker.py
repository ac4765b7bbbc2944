"""One rank's model and runner, built from an EngineConfig: the part of an engine every
tensor-parallel rank has. Rank 0 puts a scheduler and the request/output processing on top
(engine/llm_engine.py); ranks > 0 build only this and serve rank 0's steps
(distributed/worker.py).

Every rank runs ``load_worker`` and then ``Worker.allocate`` in lockstep: they hold the
collectives (replicated weights, the pool size agreed over ranks), so the order of the steps
below is part of the contract.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_llm.attention.registry import ATTENTION_BACKENDS, auto_backend_name
from paged_llm.config import EngineConfig
from paged_llm.core.kv import POLICIES
from paged_llm.distributed import building_for
from paged_llm.distributed.launch import start_tensor_parallel
from paged_llm.distributed.sharding import kv_heads_per_rank
from paged_llm.engine.loading import checkpoint_path, load_model_and_tokenizer, resolve_device
from paged_llm.kv_transfer import build_kv_connector, checkpoint_identity
from paged_llm.layers.attention import PagedAttention
from paged_llm.layers.linear_setup import merge_sibling_linears
from paged_llm.lora.manager import LoRAManager
from paged_llm.models.classification import is_classifier, pools_only
from paged_llm.models.loader import kv_cache_shape_info, max_context_len
from paged_llm.pooling.classifier import classifier_head
from paged_llm.pooling.config import resolve_pooler_config
from paged_llm.pooling.pooler import Pooler
from paged_llm.quant.kv_cache import kv_cache_spec
from paged_llm.runner.cuda_graphs import cuda_graph_sizes, mixed_capture_tokens
from paged_llm.runner.model_runner import ModelRunner
from paged_llm.runner.sleep import HeldFreeSpace, pinned_cache_bytes
from paged_llm.spec.base import DraftContext
from paged_llm.spec.registry import build_drafter
from paged_llm.utils.registry import build, target_class

logger = logging.getLogger(__name__)
PINNED_CACHE_WARN_BYTES = 64 * 2**20  # below this, a sleep losing it does not matter


@dataclass
class PoolSizes:
    """How many blocks each KV tier holds, and the bytes of one device block."""

    num_blocks: int
    num_cpu_blocks: int  # swap space (preemption_mode="swap")
    num_offload_blocks: int  # the prefix cache's CPU tier (the target's KV only)
    block_bytes: int  # the target's and a draft model's KV per block of the shared pool


@dataclass
class Worker:
    """A rank's loaded model, its runner and the optional parts the runner drives."""

    config: EngineConfig
    parallel: Any  # distributed.launch.TensorParallel, or None at tensor_parallel_size 1
    device: torch.device
    model: torch.nn.Module
    hf_config: Any
    model_dir: Path | None  # the checkpoint directory (None: a random-weight preset)
    tokenizer: Any  # None without one (or with skip_tokenizer_init)
    max_model_len: int
    backend: Any  # attention.base.AttentionBackend
    kv_spec: Any  # quant.kv_cache.KVCacheSpec
    runner: ModelRunner
    lora: LoRAManager | None
    pooler: Pooler | None
    drafter: Any  # spec.base.Drafter or None
    kv_connector: Any
    sliding_window: int | None  # blocks behind it can be freed; None: keep them all
    pools: PoolSizes
    held: HeldFreeSpace | None = None  # sleep mode: cached memory held while allocating

    @property
    def dtype(self) -> torch.dtype:
        """The model's parameter dtype."""
        return self.runner.dtype

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the LM head's rows, before any padding)."""
        return self.hf_config.vocab_size

    def allocate(self) -> None:
        """Allocate the KV pools (the target's and the drafter's) and capture CUDA graphs."""
        mc, sc, p = self.config.model, self.config.scheduler, self.pools
        self.runner.initialize_cache(p.num_blocks, p.num_cpu_blocks, p.num_offload_blocks)
        if self.drafter is not None:
            self.drafter.allocate(p.num_blocks, self.config.cache.block_size,
                                  num_cpu_blocks=p.num_cpu_blocks)  # fmt: skip
        eager = mc.enforce_eager or mc.cudagraph_mode == "NONE"
        graph_sizes = cuda_graph_sizes(
            self.device, eager, self.backend, mc.tensor_parallel_size, sc.max_num_seqs,
            enable_lora=self.lora is not None,
        )  # fmt: skip  # [] on the CPU or with enforce_eager
        # speculative steps verify 1 + up to k tokens per sequence: graphs of that stride too
        strides = (1, 1 + self.drafter.k) if self.drafter is not None else (1,)
        mixed: list[int] = []
        if graph_sizes and mc.cudagraph_mode == "FULL":
            budget = sc.token_budget(self.max_model_len)
            mixed = mixed_capture_tokens(min(mc.max_cudagraph_capture_size, budget))
        self.runner.capture_cuda_graphs(graph_sizes, self.max_model_len, strides, mixed)
        if self.held is not None:  # everything a sleep frees is allocated by now
            self.held.release()
            self.held = None
        self._log_pool()

    def _log_pool(self) -> None:
        bs, p = self.config.cache.block_size, self.pools
        tokens = p.num_blocks * bs
        logger.info(
            "KV cache: %d blocks x %d = %d tokens (%.2f GiB, %s); maximum concurrency for "
            "%d-token requests: %.2fx; attention backend: %s",
            p.num_blocks, bs, tokens, p.num_blocks * p.block_bytes / 2**30, self.kv_spec.dtype,
            self.max_model_len, tokens / self.max_model_len, self.backend.name,
        )  # fmt: skip
        if self.sliding_window is not None:
            logger.info(
                "sliding window of %d tokens: a sequence holds at most about %d blocks once "
                "decoding, blocks before its window are freed", self.sliding_window,
                -(-self.sliding_window // bs) + 1,
            )  # fmt: skip


def load_worker(config: EngineConfig) -> Worker:
    """Join the tensor-parallel world, load the model and its optional parts, build the runner
    and size the KV pools; ``Worker.allocate`` then allocates them. Raises ValueError on a
    configuration the parts cannot run, before any pool is allocated."""
    mc, cc, sc = config.model, config.cache, config.scheduler
    parallel = start_tensor_parallel(config)  # None at size 1; see distributed/launch.py
    device = parallel.device if parallel else resolve_device(mc.device)
    torch.manual_seed(mc.seed)
    backend_name = config.attention_backend
    if backend_name == "auto":
        backend_name = auto_backend_name(str(device))
    backend = build("attention backend", backend_name, ATTENTION_BACKENDS)
    backend.check_device(device)
    _check_layout(backend, sc.policy)  # on every rank, before the model loads
    held = _hold_pinned_free_space(device) if mc.enable_sleep_mode else None
    with building_for(parallel.group if parallel else None):
        model, hf_config, tokenizer = load_model_and_tokenizer(mc, device)
    if mc.skip_tokenizer_init:
        tokenizer = None
    if parallel is not None:
        parallel.sync_replicated(model)
    dtype = next(model.parameters()).dtype
    limit = max_context_len(hf_config)
    max_model_len = mc.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {limit}")
    path = checkpoint_path(str(mc.model))
    model_dir = path if path.is_dir() else None

    kv_spec = kv_cache_spec(cc.kv_cache_dtype, dtype)  # auto: the model dtype
    if kv_spec.quantized and not backend.supports_quantized_kv:
        raise ValueError(
            f"attention backend '{backend.name}' cannot read a quantized KV cache "
            f"(kv_cache_dtype='{cc.kv_cache_dtype}'); use attention_backend='torch'"
        )

    lora = _build_lora(config, model, dtype, device)  # wraps the model's linear layers
    if mc.merge_sibling_linears:  # after every wrapper (a wrapped layer stays apart)
        merge_sibling_linears(model)
    pooler = _build_pooler(config, model, hf_config, model_dir)
    drafter = build_drafter(config.speculative_config)
    if drafter is not None:
        _check_drafter_fits(config, drafter)
        drafter.load(DraftContext(device, dtype, backend, model, hf_config, parallel))
    kv_connector = _build_kv_connector(config, kv_spec, dtype, parallel, model_dir)
    num_layers, num_kv_heads, head_dim = kv_cache_shape_info(hf_config)
    runner = ModelRunner(
        model, backend, device, dtype, cc.block_size, num_layers,
        kv_heads_per_rank(num_kv_heads, mc.tensor_parallel_size), head_dim, seed=mc.seed,
        kv_spec=kv_spec, parallel=parallel, lora=lora, pooler=pooler, kv_connector=kv_connector,
        drafter=drafter,
    )  # fmt: skip
    pools = _pool_sizes(config, runner, drafter, max_model_len, parallel)
    return Worker(
        config, parallel, device, model, hf_config, model_dir, tokenizer, max_model_len, backend,
        kv_spec,
        runner, lora, pooler, drafter, kv_connector, _releasable_window(model, drafter), pools,
        held,
    )  # fmt: skip


def _check_layout(backend: Any, policy: Any) -> None:
    """Refuse a backend that needs each request's blocks in one contiguous run (the pre-vLLM
    layout) under a KV policy that does not keep them so."""
    if not backend.requires_contiguous_blocks:
        return
    cls = target_class("policy", policy, POLICIES)
    if not cls.contiguous_blocks:
        name = cls.name  # KVCacheManager's
        raise ValueError(
            f"attention backend '{backend.name}' needs contiguous per-request caches; use it "
            f"with a reservation policy (orca_max/orca_pow2/orca_oracle/static), not '{name}'"
        )


def _hold_pinned_free_space(device: torch.device) -> HeldFreeSpace:
    """Before a sleep-mode engine allocates: hold the cached CUDA memory in segments that live
    tensors pin, which a sleep could not return (runner/sleep.py); warn about what remains."""
    held = HeldFreeSpace(device)
    if held.nbytes:
        logger.info("sleep mode: holding %.2f GiB of pinned free CUDA memory while allocating",
                    held.nbytes / 2**30)  # fmt: skip
    pinned = pinned_cache_bytes(device)
    if pinned >= PINNED_CACHE_WARN_BYTES:
        logger.warning(
            "sleep mode: %.2f GiB of cached CUDA memory sits in segments that live tensors also "
            "use and could not be held (other streams, small segments); what the engine takes "
            "from it a sleep cannot hand back to the driver. Set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process first uses "
            "CUDA, or build the engine first",
            pinned / 2**30,
        )
    return held


def _build_lora(config: EngineConfig, model: Any, dtype: Any, device: Any) -> LoRAManager | None:
    """The LoRA manager (enable_lora), after refusing what it cannot be combined with."""
    lc = config.lora
    if not lc.enable_lora:
        return None
    if config.speculative_config:
        raise ValueError("enable_lora with speculative decoding is not supported")
    return LoRAManager(model, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras or lc.max_loras,
                       dtype, device)  # fmt: skip


def _build_pooler(
    config: EngineConfig, model: Any, hf_config: Any, model_dir: Path | None
) -> Pooler | None:
    """The pooler of a pooling model (runner="pooling"), its settings resolved; with the score
    head of a sequence classifier."""
    if config.model.runner != "pooling":
        if pools_only(model):
            use = "LLM.classify, or LLM.score for a cross-encoder"
            raise ValueError(
                f"{type(model).__name__} has no LM head and cannot generate: run it with "
                f"runner='pooling' ({use if is_classifier(model) else 'LLM.embed'})"
            )
        return None
    if config.speculative_config:
        raise ValueError("speculative decoding does not apply to a pooling model")
    pooler_config = resolve_pooler_config(config.model.pooler_config, model_dir)
    return Pooler(pooler_config, classifier_head(model, hf_config))


def _check_drafter_fits(config: EngineConfig, drafter: Any) -> None:
    """Refuse what a drafter with block-shared pools (an EAGLE head) cannot follow: the CPU
    tier and KV connectors move the target's pools only."""
    if not drafter.moves_with_blocks:
        return
    name = config.speculative_config.get("method", "this")
    if config.cache.kv_offloading_size:
        raise ValueError(f"speculative method '{name}' cannot be combined with kv_offloading_size")
    if config.kv_transfer_config is not None:
        raise ValueError(f"speculative method '{name}' cannot be combined with kv_transfer_config")


def _build_kv_connector(
    config: EngineConfig, kv_spec: Any, dtype: Any, parallel: Any, model_dir: Path | None
) -> Any:
    """kv_transfer_config's connector for this rank, keyed by what makes KV reusable between
    engines: the weights, their dtype and quantization, the cache layout."""
    kt = config.kv_transfer_config
    if kt is None:
        return None
    mc, cc = config.model, config.cache
    policy = config.scheduler.policy
    if isinstance(policy, str) and policy != "paged":  # reservations have no block keys
        raise ValueError(f"kv_transfer_config needs the paged policy, not '{policy}'")
    fingerprint = {
        # a random-weight preset's weights come from the seed
        "model": checkpoint_identity(model_dir) if model_dir else f"{mc.model}@seed{mc.seed}",
        "quantization": repr(mc.quantization), "dtype": str(dtype),
        "kv_cache_dtype": str(kv_spec.dtype), "block_size": cc.block_size,
        "tensor_parallel_size": mc.tensor_parallel_size,
    }  # fmt: skip
    group = parallel.group if parallel is not None else None
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    return build_kv_connector(kt, fingerprint, rank=rank, world_size=size)


def _releasable_window(model: Any, drafter: Any) -> int | None:
    """The sliding window W after which a sequence's blocks can be freed: set when every
    attention layer has one (the largest, if they differ) and no draft model reads the same
    block tables with full attention; None otherwise."""
    windows = [m.sliding_window for m in model.modules() if isinstance(m, PagedAttention)]
    if not windows or None in windows:
        return None
    if drafter is not None and drafter.bytes_per_block(1) > 0:
        return None  # the draft model's layers read every position of the shared tables
    return max(windows)


def _pool_sizes(
    config: EngineConfig, runner: ModelRunner, drafter: Any, max_model_len: int, parallel: Any
) -> PoolSizes:
    """Blocks of each tier. A 1-byte cache (+ a scale per vector) fits about twice the blocks
    of a 2-byte one; a draft model's KV shares each block of the target's pool."""
    cc = config.cache
    target_block_bytes = block_bytes = runner.block_bytes()
    if drafter is not None:
        block_bytes += drafter.bytes_per_block(cc.block_size)
    if cc.num_gpu_blocks_override is not None:
        num_blocks = cc.num_gpu_blocks_override
    elif runner.device.type == "cuda":
        num_blocks = _profile_cuda_blocks(config, runner, block_bytes, max_model_len)
    else:
        num_blocks = max(1, int(cc.cpu_kv_cache_gib * 2**30 // block_bytes))
    if parallel is not None:  # the same pool on every rank: what fits on all of them
        num_blocks = parallel.min_over_ranks(num_blocks)
    num_cpu_blocks = 0
    if config.scheduler.preemption_mode == "swap":
        num_cpu_blocks = int(cc.swap_space * 2**30 // block_bytes)
    # the offload tier holds the target's KV only (a draft model recomputes its own)
    num_offload_blocks = int(cc.kv_offloading_size * 2**30 // target_block_bytes)
    return PoolSizes(num_blocks, num_cpu_blocks, num_offload_blocks, block_bytes)


def _profile_cuda_blocks(
    config: EngineConfig, runner: ModelRunner, block_bytes: int, max_model_len: int
) -> int:
    """Blocks that fit in gpu_memory_utilization after weights and a peak forward pass."""
    from paged_llm.runner.profiling import peak_forward_bytes

    # Memory of engines dropped earlier in this process (reference cycles wait for the
    # collector) and the allocator's free cache is this engine's to use, not "in use".
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    peak = peak_forward_bytes(runner, config.scheduler, max_model_len)
    budget = total * config.cache.gpu_memory_utilization - (total - free) - peak
    if budget < block_bytes:
        raise ValueError(
            "no GPU memory left for the KV cache; raise gpu_memory_utilization or use a "
            "smaller model"
        )
    return int(budget // block_bytes)
