"""LLMEngine: vLLM's add_request / step / abort_request loop over the paged engine."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from paged_llm.attention.registry import ATTENTION_BACKENDS, auto_backend_name
from paged_llm.config import EngineArgs, EngineConfig
from paged_llm.core.build import KVPool, build_scheduler
from paged_llm.core.request import Request
from paged_llm.core.scheduler import SchedulerLimits
from paged_llm.distributed import building_for
from paged_llm.distributed.launch import CallMessage, run_call, start_tensor_parallel
from paged_llm.distributed.sharding import kv_heads_per_rank
from paged_llm.engine.deltas import DeltaCursor, stop_holdback
from paged_llm.engine.detokenizer import IncrementalDetokenizer, tokenizer_facts
from paged_llm.engine.generation_config import load_generation_defaults
from paged_llm.engine.inputs import to_token_ids, truncate_prompt, validate_token_ids
from paged_llm.engine.loading import checkpoint_path, load_model_and_tokenizer, resolve_device
from paged_llm.engine.reasoning import reasoning_parser
from paged_llm.engine.sleep_mode import SleepState, describe
from paged_llm.engine.stop_strings import StopStringChecker
from paged_llm.engine.structured_output import StructuredOutputCompiler
from paged_llm.kv_transfer import build_kv_connector, checkpoint_identity
from paged_llm.layers.attention import PagedAttention
from paged_llm.lora.manager import LoRAManager
from paged_llm.lora.request import LoRARequest
from paged_llm.models.classification import is_classifier, pools_only
from paged_llm.models.loader import kv_cache_shape_info, max_context_len, resolve_dtype
from paged_llm.outputs import (
    CompletionOutput,
    LogprobEntry,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from paged_llm.pooling.classifier import classifier_head
from paged_llm.pooling.config import resolve_pooler_config
from paged_llm.pooling.pooler import Pooler
from paged_llm.pooling_params import PoolingParams
from paged_llm.quant.kv_cache import kv_cache_spec
from paged_llm.quant.layers import QuantLinear
from paged_llm.runner.cuda_graphs import cuda_graph_sizes
from paged_llm.runner.logits_processors import bad_words_token_ids
from paged_llm.runner.model_runner import ModelRunner
from paged_llm.runner.sleep import HeldFreeSpace, pinned_cache_bytes
from paged_llm.sampling_params import RequestOutputKind, SamplingParams
from paged_llm.spec.metrics import ALL_DRAFTS, SpecDecodeStats
from paged_llm.spec.registry import build_drafter, disable_by_batch_size
from paged_llm.utils.checks import is_int
from paged_llm.utils.registry import build

logger = logging.getLogger(__name__)
MAX_ITERATION_STATS = 100_000  # ~a few hours of steps; experiments read far fewer
PINNED_CACHE_WARN_BYTES = 64 * 2**20  # below this, a sleep losing it does not matter


@dataclass
class _Tracked:
    """Engine-side state of one sequence that the scheduler does not need."""

    request: Request
    prompt: str | None
    text: str = ""
    logprobs: list[LogprobEntry] | None = None
    cumulative_logprob: float = 0.0
    num_scored: int = 0  # output tokens whose logprobs have been recorded
    sent: DeltaCursor = field(default_factory=DeltaCursor)  # RequestOutputKind.DELTA's progress
    finish_sent: bool = False  # DELTA: its finish reason has been reported
    detokenizer: IncrementalDetokenizer | None = None  # None: no text (no tokenizer or asked)
    stop_strings: StopStringChecker | None = None  # with SamplingParams.stop (also on its Request)


@dataclass
class _Group:
    """A user request: one sequence, or n parallel samples of one prompt."""

    request_id: str
    members: list[_Tracked]
    unforked: list[_Tracked]  # samples waiting to share the first member's prompt blocks
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (and
    # for tokens whose chunk has not run yet)
    prompt_logprobs: list[LogprobEntry | None] | None = None
    reported: bool = False  # an output was returned (DELTA sends prompt logprobs once)
    lora_request: LoRARequest | None = None
    pooled: Any = None  # a pooling request's output tensor, once its prompt has run


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


class LLMEngine:
    """Owns the scheduler and the model runner; each ``step()`` runs one iteration."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        mc, cc, sc = config.model, config.cache, config.scheduler
        # tensor_parallel_size > 1: launch or join the ranks; None (no torch.distributed) at 1.
        # Every rank runs this constructor in lockstep; see distributed/launch.py.
        self.parallel = start_tensor_parallel(config)
        self.device = self.parallel.device if self.parallel else resolve_device(mc.device)
        torch.manual_seed(mc.seed)
        held = _hold_pinned_free_space(self.device) if mc.enable_sleep_mode else None
        with building_for(self.parallel.group if self.parallel else None):
            self.model, self.hf_config, self.tokenizer = load_model_and_tokenizer(mc, self.device)
        if mc.skip_tokenizer_init:
            self.tokenizer = None
        # how incremental detokenization reads this tokenizer; None: decode whole outputs
        self._tokenizer_facts = None if self.tokenizer is None else tokenizer_facts(self.tokenizer)
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs
        if self.parallel is not None:
            self.parallel.sync_replicated(self.model)
        self.dtype = next(self.model.parameters()).dtype
        limit = max_context_len(self.hf_config)
        self.max_model_len = mc.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's {limit}")
        self.vocab_size = self.hf_config.vocab_size
        self.eos_token_id = self._eos_token_id()
        path = checkpoint_path(str(mc.model))
        self.generation_defaults = load_generation_defaults(
            path if path.is_dir() else None, self.hf_config, mc.generation_config,
            mc.override_generation_config, self.vocab_size,
        )  # fmt: skip

        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = auto_backend_name(str(self.device))
        self.backend = build("attention backend", backend_name, ATTENTION_BACKENDS)
        self.backend.check_device(self.device)

        num_layers, num_kv_heads, head_dim = kv_cache_shape_info(self.hf_config)
        num_kv_heads = kv_heads_per_rank(num_kv_heads, mc.tensor_parallel_size)  # this rank's
        kv_spec = kv_cache_spec(cc.kv_cache_dtype, self.dtype)  # auto: the model dtype
        if kv_spec.quantized and not self.backend.supports_quantized_kv:
            raise ValueError(
                f"attention backend '{self.backend.name}' cannot read a quantized KV cache "
                f"(kv_cache_dtype='{cc.kv_cache_dtype}'); use attention_backend='torch'"
            )
        self.runner = ModelRunner(
            self.model, self.backend, self.device, self.dtype, cc.block_size,
            num_layers, num_kv_heads, head_dim, seed=mc.seed, kv_spec=kv_spec,
            parallel=self.parallel,
        )  # fmt: skip
        # A 1-byte cache (+ a scale per vector) fits about twice the blocks of a 2-byte one.
        target_block_bytes = block_bytes = self.runner.block_bytes()
        self.lora = self._build_lora()  # wraps the model's linear layers when enabled
        self.runner.lora = self.lora
        self.pooler = self._build_pooler(path if path.is_dir() else None)
        self.runner.pooler = self.pooler
        self.drafter = build_drafter(config.speculative_config)
        self._structured: StructuredOutputCompiler | None = None  # built on first guided request
        # with a reasoning parser, grammars wait for the end of the thought (tags as token ids)
        self.reasoning = reasoning_parser(mc.reasoning_parser) if mc.reasoning_parser else None
        self.reasoning_tags = self.reasoning.tag_ids(self.tokenizer) if self.reasoning else None
        if self.drafter is not None:
            self._check_drafter_fits()
            self.drafter.load(self)
            block_bytes += self.drafter.bytes_per_block(cc.block_size)  # both pools share blocks
        self.spec_stats = SpecDecodeStats()
        num_blocks = self._num_blocks(block_bytes)
        if self.parallel is not None:  # the same pool on every rank: what fits on all of them
            num_blocks = self.parallel.min_over_ranks(num_blocks)
        num_cpu_blocks = 0
        if sc.preemption_mode == "swap":
            num_cpu_blocks = int(cc.swap_space * 2**30 // block_bytes)
        # the offload tier holds the target's KV only (a draft model recomputes its own)
        num_offload_blocks = int(cc.kv_offloading_size * 2**30 // target_block_bytes)
        window = self._releasable_window()
        self.kv_connector = self._build_kv_connector(kv_spec)
        self.runner.kv_connector = self.kv_connector
        pool = KVPool(
            num_blocks, cc.block_size, self.max_model_len, num_cpu_blocks, num_offload_blocks,
            cc.enable_prefix_caching, window, self.kv_connector,
        )  # fmt: skip
        limits = SchedulerLimits(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens or max(self.max_model_len, 2048),
            enable_chunked_prefill=sc.enable_chunked_prefill,
            preemption_mode=sc.preemption_mode,
            num_lookahead_slots=self.drafter.k if self.drafter is not None else 0,
            spec_disable_batch_size=disable_by_batch_size(config.speculative_config),
            scheduling_policy=sc.scheduling_policy,
            max_loras=config.lora.max_loras if self.lora is not None else 0,
        )
        self.scheduler = build_scheduler(sc.policy, pool, limits)
        kv = self.scheduler.kv
        if self.backend.requires_contiguous_blocks and not kv.contiguous_blocks:
            raise ValueError(
                f"attention backend '{self.backend.name}' needs contiguous per-request caches; "
                f"use it with a reservation policy (orca_max/orca_pow2/orca_oracle/static), "
                f"not '{kv.name}'"
            )
        self.runner.initialize_cache(num_blocks, num_cpu_blocks, num_offload_blocks)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks, cc.block_size, num_cpu_blocks=num_cpu_blocks)
            if self.drafter.runs_model:  # its weights and KV sleep, its graphs are captured
                self.runner.memory_owners.append(self.drafter)
            if self.drafter.moves_with_blocks:  # pools that move with the target's blocks
                self.runner.block_companions.append(self.drafter)
            self.runner.keep_hidden = self.drafter.reads_hidden_states
        self.sleep_state = SleepState(enabled=mc.enable_sleep_mode)
        graph_sizes = cuda_graph_sizes(
            self.device, mc.enforce_eager, self.backend, mc.tensor_parallel_size, sc.max_num_seqs,
            enable_lora=self.lora is not None,
        )  # fmt: skip  # [] on the CPU or with enforce_eager
        # speculative steps verify 1 + up to k tokens per sequence: graphs of that stride too
        strides = (1, 1 + self.drafter.k) if self.drafter is not None else (1,)
        self.runner.capture_cuda_graphs(graph_sizes, self.max_model_len, strides)
        if held is not None:  # everything a sleep frees is allocated by now
            held.release()
        tokens = num_blocks * cc.block_size
        logger.info(
            "KV cache: %d blocks x %d = %d tokens (%.2f GiB, %s); maximum concurrency for "
            "%d-token requests: %.2fx; attention backend: %s",
            num_blocks, cc.block_size, tokens, num_blocks * block_bytes / 2**30, kv_spec.dtype,
            self.max_model_len, tokens / self.max_model_len, self.backend.name,
        )  # fmt: skip
        if window is not None:
            logger.info(
                "sliding window of %d tokens: a sequence holds at most about %d blocks once "
                "decoding, blocks before its window are freed", window,
                -(-window // cc.block_size) + 1,
            )  # fmt: skip
        self.kv_cache_tokens = tokens
        self._groups: dict[str, _Group] = {}  # user request id -> its samples
        self._seqs: dict[str, tuple[_Group, _Tracked]] = {}  # sequence id -> (group, state)
        self._counter = itertools.count()
        # One IterationStats per step, for experiments; the oldest half is dropped past
        # MAX_ITERATION_STATS so a long-lived engine does not grow without bound.
        self.iteration_stats: list[Any] = []
        self._last_log = float("-inf")
        if self.parallel is not None:
            self.parallel.finish_startup(self.runner)  # ranks > 0 serve rank 0's steps here

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and leave the process group (no-op at size 1)."""
        if self.parallel is not None:
            self.parallel.shutdown()

    # ---- set-up helpers ---------------------------------------------------------------------
    def _eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list) else eos

    def _build_lora(self) -> LoRAManager | None:
        """The LoRA manager (enable_lora), after refusing what it cannot be combined with."""
        lc = self.config.lora
        if not lc.enable_lora:
            return None
        if self.config.speculative_config:
            raise ValueError("enable_lora with speculative decoding is not supported")
        return LoRAManager(
            self.model, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras or lc.max_loras,
            self.dtype, self.device,
        )  # fmt: skip

    def _build_pooler(self, model_dir: Any) -> Pooler | None:
        """The pooler of a pooling model (runner="pooling"), its settings resolved; with the
        score head of a sequence classifier."""
        if self.config.model.runner != "pooling":
            if pools_only(self.model):
                use = "LLM.classify, or LLM.score for a cross-encoder"
                raise ValueError(
                    f"{type(self.model).__name__} has no LM head and cannot generate: run it "
                    f"with runner='pooling' ({use if is_classifier(self.model) else 'LLM.embed'})"
                )
            return None
        if self.config.speculative_config:
            raise ValueError("speculative decoding does not apply to a pooling model")
        config = resolve_pooler_config(self.config.model.pooler_config, model_dir)
        return Pooler(config, classifier_head(self.model, self.hf_config))

    def _check_drafter_fits(self) -> None:
        """Refuse what a drafter with block-shared pools (an EAGLE head) cannot follow: the
        CPU tier and KV connectors move the target's pools only."""
        if not self.drafter.moves_with_blocks:
            return
        name = self.config.speculative_config.get("method", "this")
        if self.config.cache.kv_offloading_size:
            raise ValueError(f"speculative method '{name}' cannot be combined with "
                             "kv_offloading_size")  # fmt: skip
        if self.config.kv_transfer_config is not None:
            raise ValueError(f"speculative method '{name}' cannot be combined with "
                             "kv_transfer_config")  # fmt: skip

    def _build_kv_connector(self, kv_spec: Any) -> Any:
        """kv_transfer_config's connector for this rank, keyed by what makes KV reusable
        between engines: the weights, their dtype and quantization, the cache layout."""
        kt = self.config.kv_transfer_config
        if kt is None:
            return None
        mc, cc = self.config.model, self.config.cache
        policy = self.config.scheduler.policy
        if isinstance(policy, str) and policy != "paged":  # reservations have no block keys
            raise ValueError(f"kv_transfer_config needs the paged policy, not '{policy}'")
        path = checkpoint_path(str(mc.model))
        fingerprint = {
            # a random-weight preset's weights come from the seed
            "model": checkpoint_identity(path) if path.is_dir() else f"{mc.model}@seed{mc.seed}",
            "quantization": repr(mc.quantization), "dtype": str(self.dtype),
            "kv_cache_dtype": str(kv_spec.dtype), "block_size": cc.block_size,
            "tensor_parallel_size": mc.tensor_parallel_size,
        }  # fmt: skip
        group = self.parallel.group if self.parallel is not None else None
        rank, size = (group.rank, group.size) if group is not None else (0, 1)
        return build_kv_connector(kt, fingerprint, rank=rank, world_size=size)

    def _releasable_window(self) -> int | None:
        """The sliding window W after which a sequence's blocks can be freed: set when every
        attention layer has one (the largest, if they differ) and no draft model reads the
        same block tables with full attention; None otherwise."""
        windows = [m.sliding_window for m in self.model.modules() if isinstance(m, PagedAttention)]
        if not windows or None in windows:
            return None
        if self.drafter is not None and self.drafter.bytes_per_block(1) > 0:
            return None  # the draft model's layers read every position of the shared tables
        return max(windows)

    def _num_blocks(self, block_bytes: int) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(block_bytes)
        return max(1, int(cc.cpu_kv_cache_gib * 2**30 // block_bytes))

    def _profile_cuda_blocks(self, block_bytes: int) -> int:
        """Blocks that fit in gpu_memory_utilization after weights and a peak forward pass."""
        from paged_llm.runner.profiling import peak_forward_bytes

        # Memory of engines dropped earlier in this process (reference cycles wait for the
        # collector) and the allocator's free cache is this engine's to use, not "in use".
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = peak_forward_bytes(self.runner, self.config.scheduler, self.max_model_len)
        budget = total * self.config.cache.gpu_memory_utilization - (total - free) - peak
        if budget < block_bytes:
            raise ValueError(
                "no GPU memory left for the KV cache; raise gpu_memory_utilization or use a "
                "smaller model"
            )
        return int(budget // block_bytes)

    # ---- requests ---------------------------------------------------------------------------
    def _structured_outputs(self) -> StructuredOutputCompiler:
        """The grammar compiler for this tokenizer, built on first use (xgrammar is optional)."""
        if self._structured is None:
            self._structured = StructuredOutputCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_id
            )
        return self._structured

    def _guide(self, guided: Any, prompt_ids: list[int]) -> Any:
        """A fresh guide for one sample; with a reasoning parser it waits for the thought."""
        guide = self._structured_outputs().guide(guided)
        if self.reasoning is None:
            return guide
        return self.reasoning.gate(guide, prompt_ids, self.reasoning_tags)

    def make_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> _Group:
        """Validate a prompt and its parameters; raise ValueError before any work is done
        (EngineAsleepError while sleep mode has the engine's memory)."""
        self.sleep_state.check_awake()
        if self.parallel is not None and not self.parallel.is_driver:
            raise ValueError(
                f"tensor-parallel rank {self.parallel.group.rank} only runs the model; "
                "submit requests on rank 0"
            )
        if self.pooler is not None or isinstance(params, PoolingParams):
            return self._make_pooling_request(
                request_id, prompt, params, arrival_time, priority, lora_request
            )
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        self.scheduler.check_group_size(params.best_of, "n/best_of")  # before any per-sample work
        self._check_priority(priority)
        lora_id = self._check_lora(lora_request)
        text, ids = self._prompt_ids(prompt, params.truncate_prompt_tokens)
        validate_token_ids(ids, self.vocab_size, self.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer, and this model has none: use stop_token_ids"
            )
        for name, ids_ in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", params.logit_bias or {}),
                           ("allowed_token_ids", params.allowed_token_ids or [])):  # fmt: skip
            outside = [t for t in ids_ if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(
                    f"{name} {outside[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        for name in ("logprobs", "prompt_logprobs"):  # top-k alternatives come from the vocab
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} exceeds the vocabulary size {self.vocab_size}")
        # the checkpoint's other EOS ids (generation_config.json) end it too
        params = self.generation_defaults.add_eos_stops(params, self.eos_token_id)
        bad_words = bad_words_token_ids(params.bad_words or [], self.tokenizer)
        guided = params.guided_decoding
        guides = (
            [self._guide(guided, ids) for _ in range(params.best_of)]
            if guided
            else [None] * params.best_of
        )
        if guided and params.allowed_token_ids is not None:
            first = guides[0].allowed()  # [V] bool: the grammar's possible first tokens
            if not bool(first[torch.tensor(params.allowed_token_ids)].any()):
                raise ValueError(
                    "allowed_token_ids and guided_decoding leave no token to start with: the "
                    "grammar accepts none of the allowed tokens first"
                )
        arrival = self.clock() if arrival_time is None else arrival_time
        members = []
        for i in range(params.best_of):
            # each sample draws its own random stream; a user seed stays reproducible
            p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
            detokenizer = self._detokenizer_for(p)
            stops = StopStringChecker(detokenizer, p) if detokenizer and p.stop else None
            request = Request(
                request_id=request_id if i == 0 else f"{request_id}#{i}",
                prompt_token_ids=ids,
                sampling_params=p,
                arrival_time=arrival,
                priority=priority,
                lora_int_id=lora_id,
                eos_token_id=self.eos_token_id,
                max_model_len=self.max_model_len,
                group_id=request_id if params.best_of > 1 else None,
                bad_words_token_ids=bad_words,
                guide=guides[i],
                stop_strings=stops,
            )
            members.append(_Tracked(request, text, logprobs=[] if p.logprobs is not None else None,
                                    detokenizer=detokenizer, stop_strings=stops))  # fmt: skip
        self.scheduler.check_group_fits([t.request for t in members], "n/best_of")
        prompt_lps = None if params.prompt_logprobs is None else [None] * len(ids)
        return _Group(request_id, members, unforked=[], prompt_logprobs=prompt_lps,
                      lora_request=lora_request)  # fmt: skip

    def _make_pooling_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        arrival_time: float | None,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> _Group:
        """Validate a pooling (embedding) request; raise ValueError before any work is done."""
        if self.pooler is None:
            raise ValueError(
                "got PoolingParams, but this engine generates; start it with runner='pooling' "
                "to embed"
            )
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"this is a pooling model (runner='pooling'): expected PoolingParams, got "
                f"{type(params).__name__}; use LLM.embed / LLM.encode"
            )
        params.validate()
        if self.pooler.head is not None and params.dimensions is not None:
            raise ValueError("dimensions applies to embeddings, not to a classifier's labels")
        self._check_dimensions(params)
        self._check_priority(priority)
        lora_id = self._check_lora(lora_request)
        text, ids = self._prompt_ids(prompt, params.truncate_prompt_tokens)
        validate_token_ids(ids, self.vocab_size, self.max_model_len, generates=False)
        request = Request(
            request_id=request_id, prompt_token_ids=ids, sampling_params=SamplingParams(),
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority, lora_int_id=lora_id, max_model_len=self.max_model_len,
            pooling_params=params, pool_all_tokens=self.pooler.method.needs_all_tokens,
        )  # fmt: skip
        return _Group(request_id, [_Tracked(request, text)], unforked=[],
                      lora_request=lora_request)  # fmt: skip

    def _prompt_ids(self, prompt: Any, keep: int | None) -> tuple[str | None, list[int]]:
        """The prompt's (text, token ids), cut to its last ``keep`` ids (truncate_prompt_tokens)
        before any length check; the text of a cut prompt is its kept ids decoded."""
        text, ids = to_token_ids(prompt, self.tokenizer)
        kept = truncate_prompt(ids, keep)
        if len(kept) < len(ids):
            return (self.tokenizer.decode(kept) if self.tokenizer is not None else None), kept
        return text, ids

    def _check_dimensions(self, params: PoolingParams) -> None:
        """PoolingParams.dimensions only for Matryoshka models, and at most the hidden size."""
        if params.dimensions is None:
            return
        matryoshka = getattr(self.hf_config, "is_matryoshka", False) or getattr(
            self.hf_config, "matryoshka_dimensions", None
        )
        if not matryoshka:
            raise ValueError(
                "dimensions is only for Matryoshka embedding models (config.json: "
                "is_matryoshka or matryoshka_dimensions); this model is not one"
            )
        allowed = getattr(self.hf_config, "matryoshka_dimensions", None)
        if allowed and params.dimensions not in allowed:
            raise ValueError(f"dimensions={params.dimensions} is not one of {allowed}")
        if params.dimensions > self.hf_config.hidden_size:
            raise ValueError(
                f"dimensions={params.dimensions} exceeds the hidden size "
                f"{self.hf_config.hidden_size}"
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; return its id. Bad input raises and changes nothing.
        ``priority`` (with ``scheduling_policy="priority"``): smaller runs sooner;
        ``lora_request`` (with ``enable_lora``): the adapter to run it with."""
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id '{request_id}' is already in use")
        group = self.make_request(request_id, prompt, params, arrival_time, priority, lora_request)
        self._enqueue(group)
        return request_id

    def _check_lora(self, lora_request: LoRARequest | None) -> int:
        """The request's adapter id (0: none), its adapter checked and loaded on first use."""
        if lora_request is None:
            return 0
        if self.lora is None:
            raise ValueError("got a lora_request, but LoRA is not enabled; use enable_lora=True")
        self.add_lora(lora_request)
        return lora_request.lora_int_id

    # ---- LoRA adapters (vLLM's LLMEngine methods) ---------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and load an adapter ahead of its requests; False if it was already loaded."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled; use enable_lora=True")
        added = self.lora.add(lora_request)  # checked here first: a bad adapter raises alone
        if added and self.parallel is not None:  # every rank keeps its part of each layer
            self.collective_rpc("add_lora", args=(lora_request,))
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; refused (ValueError) while requests still use it."""
        if self.lora is None:
            return False
        if any(r.lora_int_id == lora_id for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter {lora_id} is in use by unfinished requests")
        return self.collective_rpc("remove_lora", args=(lora_id,))[0]

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters."""
        return set(self.lora.list()) if self.lora is not None else set()

    def _check_priority(self, priority: int) -> None:
        if not is_int(priority):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and not self.scheduler.queue.orders_by_priority:
            raise ValueError(
                f"got priority {priority}, but scheduling_policy is "
                f"'{self.scheduler.queue.name}'; use scheduling_policy='priority'"
            )

    def _enqueue(self, group: _Group) -> None:
        """Queue a validated group. With a sharing policy, samples 2..n wait for the first one's
        prefill and then fork its blocks; otherwise each sample is an independent request."""
        first, rest = group.members[0], group.members[1:]
        self.scheduler.add_request(first.request)
        if self.scheduler.kv.supports_sharing:
            group.unforked = list(rest)
        else:
            for t in rest:
                self.scheduler.add_request(t.request)
        self._groups[group.request_id] = group
        for t in group.members:
            self._seqs[t.request.request_id] = (group, t)

    def _fork_samples(self, out: Any) -> None:
        """Fork waiting samples off a first sample whose prefill completes in this step."""
        for s in out.scheduled:
            entry = self._seqs.get(s.request.request_id)
            if entry is None or not entry[0].unforked or not s.samples:
                continue
            group, first = entry
            for t in group.unforked:
                # recompute the last prompt token so each sample draws its own first token
                t.request.num_computed_tokens = first.request.num_prompt_tokens - 1
                self.scheduler.fork_request(first.request, t.request)
            group.unforked = []

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort one or more requests (all their samples) and free their blocks."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for t in group.members:
                self.scheduler.abort_request(t.request.request_id)
                self._forget(t.request.request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self._groups) or self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Number of user requests not yet finished."""
        return len(self._groups)

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return outputs of requests that progressed."""
        out = self.scheduler.schedule(self.clock())
        self._fork_samples(out)
        if self.runner.block_companions:  # the drafter reads the blocks this step copies or swaps
            self.runner.apply_block_ops(out.block_ops)
            out.block_ops = []
        draft_probs, draft_sources = self._propose_drafts(out)
        starts = {s.request.request_id: s.request.num_computed_tokens for s in out.scheduled}
        results, prompt_lps, pooled = self.runner.execute(out, draft_probs)
        for rid, (first, entries) in prompt_lps.items():
            group = self._seqs[rid][0]  # recomputed after preemption: the same values again
            for entry in entries:
                self._name_tokens(entry, group.members[0].request.sampling_params)
            group.prompt_logprobs[first : first + len(entries)] = entries
        now = self.clock()
        sampled = {rid: r.token_ids for rid, r in results.items()}
        for rid, r in results.items():
            self.spec_stats.record(r.num_drafts, r.num_accepted, draft_sources.get(rid, ALL_DRAFTS))
        self.scheduler.update_from_output(out, sampled, now)
        if self.runner.last_hidden is not None:  # an EAGLE head follows the target's features
            self.drafter.observe(out.scheduled, starts, self.runner.last_hidden,
                                 will_draft=self.scheduler.drafts_next_step())  # fmt: skip
        if out.stats is not None:
            if len(self.iteration_stats) >= MAX_ITERATION_STATS:
                del self.iteration_stats[: MAX_ITERATION_STATS // 2]
            self.iteration_stats.append(out.stats)
            self._maybe_log_stats(out.stats, now)
        touched: dict[str, _Group] = {}
        for rid, data in pooled.items():  # pooling requests whose prompt this step completed
            entry = self._seqs.get(rid)
            if entry is not None:
                group = entry[0]
                group.pooled = data
                touched[group.request_id] = group
        for rid, result in results.items():
            entry = self._seqs.get(rid)
            if entry is None:
                continue
            group, tracked = entry
            self._record_logprobs(tracked, result)
            self._detokenize(tracked)
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            output = self._output(group)
            if output is None:  # FINAL_ONLY, still running
                continue
            outputs.append(output)
            if output.finished:
                self._release(group)
        return outputs

    def _propose_drafts(self, out: Any) -> tuple[dict[str, Any], dict[str, str]]:
        """Fill the lookahead slots of this step's decodes with draft tokens to verify; return
        the draft distributions and, from a drafter that tells them apart, each request's
        draft source (for ``spec_stats``)."""
        if self.drafter is None:
            return {}, {}
        entries = [s for s in out.scheduled if s.num_lookahead and s.samples]
        if not entries:
            return {}, {}
        drafts, probs = self.drafter.propose(entries, self.runner.sampler)
        for s in entries:
            d = drafts.get(s.request.request_id, [])[: s.num_lookahead]
            if s.request.guide is not None:  # verify only what the grammar could accept
                d = d[: s.request.guide.valid_prefix(d)]
            s.request.spec_token_ids = d
            s.num_new_tokens = 1 + len(d)
        return probs, self.drafter.draft_sources

    def _release(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for t in group.members:
            self._forget(t.request.request_id)

    def _forget(self, seq_id: str) -> None:
        """Drop a finished or aborted sequence's state outside the scheduler."""
        self._seqs.pop(seq_id, None)
        self.runner.sampler.forget(seq_id)
        if self.pooler is not None:
            self.pooler.forget(seq_id)
        if self.drafter is not None:  # else a later request with this id drafts from stale KV
            self.drafter.forget(seq_id)

    def _maybe_log_stats(self, stats: Any, now: float) -> None:
        """vLLM-style periodic status line (with ``log_stats=True``), every 5 s."""
        if not self.config.log_stats or now - self._last_log < 5.0:
            return
        self._last_log = now
        logger.info(
            "Running: %d reqs, Swapped: %d reqs, Pending: %d reqs, KV cache usage: %.1f%%, "
            "batched tokens: %d, preemptions so far: %d",
            stats.num_running, stats.num_swapped, stats.num_waiting, 100 * stats.kv_usage,
            stats.num_batched_tokens, self.scheduler.num_preemptions_total,
        )  # fmt: skip

    def _record_logprobs(self, tracked: _Tracked, result: Any) -> None:
        """Add the logprobs of the step's tokens that joined the output: a speculative step
        has several, and a stop (or an abort) may have ended the step early."""
        if result.logprobs is None:  # the sampler computes them when the request tracks them
            return
        kept = min(len(tracked.request.output_token_ids) - tracked.num_scored,
                   len(result.token_ids))  # fmt: skip
        for token, entry in zip(result.token_ids[:kept], result.logprobs[:kept]):
            if tracked.logprobs is not None:
                self._name_tokens(entry, tracked.request.sampling_params)
                tracked.logprobs.append(entry)
            tracked.cumulative_logprob += entry[token]
        tracked.num_scored += kept

    def _name_tokens(self, entry: LogprobEntry, params: SamplingParams) -> None:
        """Fill each Logprob's ``decoded_token`` (the token's own text), as vLLM does."""
        if self.tokenizer is not None and params.detokenize:
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        """One token's own text (needs a tokenizer); decoded once per vocabulary entry, ever."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _detokenizer_for(self, p: SamplingParams) -> IncrementalDetokenizer | None:
        """A sequence's text keeper, or None when it has no text."""
        if self.tokenizer is None or not p.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            p.skip_special_tokens,
            p.spaces_between_special_tokens,
            self._tokenizer_facts,
        )

    def _detokenize(self, tracked: _Tracked) -> None:
        """Update the text: cut at a stop string (found by the scheduler, token by token), and
        without the text of a stop token."""
        if tracked.detokenizer is None:
            return
        req = tracked.request
        ids = req.output_token_ids
        if req.stopped_by_token and not req.sampling_params.include_stop_str_in_output:
            ids = ids[:-1]  # vLLM leaves the stop token's text out
        text = tracked.detokenizer.update(ids)
        if tracked.stop_strings is not None and tracked.stop_strings.cut is not None:
            text = text[: tracked.stop_strings.cut]
        tracked.text = text

    @staticmethod
    def _completion(index: int, tracked: _Tracked, delta: bool = False) -> CompletionOutput:
        """One sequence's output: all of it, or (``delta``) what is new since the last one."""
        req = tracked.request
        text, token_ids, logprobs = tracked.text, list(req.output_token_ids), tracked.logprobs
        if delta:
            holdback = stop_holdback(req.sampling_params)
            text, token_ids, logprobs = tracked.sent.take(
                text, token_ids, logprobs, req.is_finished, holdback
            )
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=(
                tracked.cumulative_logprob if req.sampling_params.tracks_logprobs else None
            ),
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=req.status.value if req.is_finished else None,
            stop_reason=req.stop_reason,
        )

    def _delta_completions(self, group: _Group) -> list[CompletionOutput]:
        """DELTA: the samples with new tokens or text, or whose finish is not reported yet."""
        completions = []
        for i, t in enumerate(group.members):
            c = self._completion(i, t, delta=True)
            if c.token_ids or c.text or (c.finish_reason is not None and not t.finish_sent):
                t.finish_sent = c.finish_reason is not None
                completions.append(c)
        return completions

    def _output(self, group: _Group) -> RequestOutput | PoolingRequestOutput | None:
        """The request's output after this step (None: FINAL_ONLY and still running)."""
        first = group.members[0]
        req = first.request
        if req.is_pooling:
            return PoolingRequestOutput(
                request_id=group.request_id, outputs=PoolingOutput(group.pooled),
                prompt_token_ids=req.prompt_token_ids, finished=req.is_finished,
                prompt=first.prompt, num_cached_tokens=req.num_cached_tokens,
                lora_request=group.lora_request,
                metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time,
                                       finished_time=req.finished_time),
            )  # fmt: skip
        finished = not group.unforked and all(t.request.is_finished for t in group.members)
        kind = req.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        times = [t.request.finished_time for t in group.members if t.request.finished_time]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=max(times) if finished and times else None,
            token_times=list(req.token_times),
            num_preemptions=sum(t.request.num_preemptions for t in group.members),
        )
        params = req.sampling_params
        prompt_logprobs = group.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            completions = self._delta_completions(group)
            prompt_logprobs = None if group.reported else prompt_logprobs
        else:
            shown = group.members
            if params.best_of > params.n:  # vLLM V0: the n highest cumulative logprobs so far
                shown = sorted(shown, key=lambda t: t.cumulative_logprob, reverse=True)
            completions = [self._completion(i, t) for i, t in enumerate(shown[: params.n])]
        group.reported = True
        return RequestOutput(
            request_id=group.request_id,
            prompt=first.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens,
            lora_request=group.lora_request,
        )

    def iter_outputs(self) -> Iterator[RequestOutput]:
        """Step until every request finishes, yielding each step's outputs (streaming)."""
        while self.has_unfinished_requests():
            yield from self.step()

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the device KV pool."""
        return self.scheduler.kv.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. between benchmark runs); False, and nothing dropped,
        while requests are running."""
        return self.scheduler.kv.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy Hugging-Face-named tensors (a whole checkpoint or any part of it, e.g. the
        layers an RL step trained) into the model in place, between requests; the prefix
        cache, whose KV the old weights computed, is dropped. Returns the tensors written."""
        if self.has_unfinished_requests():
            raise ValueError("load_weights runs between requests; some are still running")
        if self._quantized():
            raise ValueError("load_weights needs float weights; this model is quantized")
        self.sleep_state.check_can_load()
        if self.parallel is not None:  # pickled to every rank, which keeps its own slices
            weights = [(n, t.detach().cpu()) for n, t in weights]
        written = self.collective_rpc("update_weights", args=(weights,))[0]  # checked first
        self.sleep_state.loaded(written)
        self.reset_prefix_cache()
        return len(written)

    def _quantized(self) -> bool:
        return any(isinstance(m, QuantLinear) for m in self.model.modules())

    # ---- calls on every rank, and sleep mode (vLLM's methods for RL and multi-model use) ------
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Between steps, run ``runner.<method>(*args, **kwargs)`` (a ``ModelRunner`` method)
        or ``method(runner, *args, **kwargs)`` on every tensor-parallel rank; the results in
        rank order. Under tensor parallelism the function, arguments and results are pickled."""
        if timeout is not None:
            raise ValueError("collective_rpc does not support timeout; leave it None")
        msg = CallMessage(method, tuple(args), dict(kwargs or {}))
        if self.parallel is None:
            return [run_call(self.runner, msg.method, msg.args, msg.kwargs)]
        return self.parallel.call(self.runner, msg)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """``func(model)`` on every rank's model (its slices under tensor parallelism)."""
        return self.collective_rpc("apply_model", args=(func,))

    def sleep(self, level: int = 1) -> None:
        """Between requests (with ``enable_sleep_mode=True``), free the device memory of every
        rank: the KV cache is discarded, the weights offloaded to CPU memory (level 1) or
        discarded (level 2: for load_weights to write new ones after ``wake_up``). The prefix
        cache is dropped. Requests are refused (EngineAsleepError) until ``wake_up``."""
        busy = self.has_unfinished_requests()
        self.sleep_state.check_can_sleep(level, busy, self._quantized())
        self.reset_prefix_cache()
        reports = self.collective_rpc("sleep", args=(level,))
        self.sleep_state.fell_asleep(level, (n for n, _ in self.model.named_parameters()))
        logger.info(describe(reports, self.device.type))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the memory of ``tags`` ("weights", "kv_cache"; None: both): wake the
        weights first to update them (load_weights) before the KV cache takes its memory."""
        tags = self.sleep_state.tags_to_wake(tags)
        if tags:
            self.collective_rpc("wake_up", args=(tags,))
        self.sleep_state.woke(tags)

    def is_sleeping(self) -> bool:
        """True while any of the engine's memory is asleep."""
        return bool(self.sleep_state.asleep)

    def kv_usage(self) -> float:
        """Fraction of device KV blocks in use."""
        return self.scheduler.kv.usage()

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None if it has none)."""
        return self.tokenizer

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, **kwargs: Any) -> LLMEngine:
        """Build from vLLM's ``EngineArgs`` or from the same keyword arguments."""
        if engine_args is None:
            engine_args = EngineArgs(**kwargs)
        elif kwargs:
            raise ValueError("pass EngineArgs or keyword arguments, not both")
        return cls(engine_args.create_engine_config())


__all__ = ["LLMEngine", "resolve_dtype"]
