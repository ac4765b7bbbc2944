"""Turns a SchedulerOutput into tensors, runs the model over the paged cache, and samples."""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
from torch import nn

from paged_llm.attention.base import AttentionBackend
from paged_llm.core.scheduler import ScheduledRequest, SchedulerOutput
from paged_llm.layers.attention import ForwardContext
from paged_llm.quant.kv_cache import SCALE_DTYPE, KVCacheSpec
from paged_llm.runner.async_tokens import DeferredTokens, can_defer, feed_placeholders
from paged_llm.runner.batch import (
    BlockTableRows,
    HostBatch,
    flatten_batch,
    is_decode_batch,
    to_step_inputs,
)
from paged_llm.runner.controls import RunnerControls
from paged_llm.runner.cuda_graphs import VARLEN, CudaGraphRunner
from paged_llm.runner.kv_cache import (
    KVCaches,
    allocate_kv_caches,
    allocate_kv_scales,
    kv_bytes_per_block,
    move_blocks,
)
from paged_llm.runner.logprobs import PromptLogprobs, pack_prompt_logprobs, prompt_logprobs
from paged_llm.runner.sampler import PendingTokens, Sampler, SampleResult
from paged_llm.runner.sleep import (
    Sleeper,
)
from paged_llm.utils.host import int_tensor, to_device


class ModelRunner(RunnerControls):
    """Owns the model, its KV pools (device and swap) and the sampler (CUDA graph capture,
    sleep mode, weight updates and LoRA adapters, between steps: runner/controls.py)."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        seed: int = 0,
        kv_spec: KVCacheSpec | None = None,  # cache layout; default: unquantized in ``dtype``
        parallel: Any = None,  # distributed.launch.TensorParallel on rank 0 of a TP world
        lora: Any = None,  # lora.manager.LoRAManager when LoRA is enabled
        pooler: Any = None,  # pooling.pooler.Pooler for a pooling model
        kv_connector: Any = None,  # kv_transfer_config's connector (its worker side: load, save)
        drafter: Any = None,  # spec.base.Drafter: its flags say what the runner does for it
    ) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sampler = Sampler(seed)
        self.table_rows = BlockTableRows()  # block tables as int64 rows, kept across steps
        self.parallel = parallel
        self.lora = lora
        self.pooler = pooler
        self.cuda_graphs: CudaGraphRunner | None = None  # see capture_cuda_graphs
        # capture_cuda_graphs' arguments (sizes, max_model_len, strides, mixed tokens): wake_up
        # redoes it
        self._graph_args: tuple[list[int], int, tuple[int, ...], tuple[int, ...]] = (
            [], 0, (1,), ()
        )  # fmt: skip
        self.sleeper = Sleeper()
        # other owners of this rank's device memory (a draft model): ``device_memory()``; their
        # weights and KV sleep with the target's and their graphs are captured beside its own
        self.memory_owners: list[Any] = [drafter] if drafter and drafter.runs_model else []
        self.cuda_graph_error: str | None = None  # why capturing failed, if it did
        # How each forward ran ("graph" replay of a decode graph, "graph_q<stride>" of a longer
        # stride, "graph_mixed" of a mixed-step graph, "eager_decode", "eager_prefill": any
        # other batch, a verification included),
        # counted and last: benchmarks attribute step time by kind.
        self.forward_kinds: collections.Counter[str] = collections.Counter()
        self.last_forward_kind: str | None = None
        # perf_counter() marks that profiles read: the step's inputs are on the device (blocks
        # moved, batch tensors or graph buffers loaded), and execute's forward returned
        self.inputs_done = 0.0
        self.model_done = 0.0
        # async scheduling: the last step's sampled ids, if it left them on the device (the
        # next step's placeholder tokens read them there)
        self.last_sampled: DeferredTokens | None = None
        self.deferred_steps = 0  # steps whose ids it left on the device (benchmarks read it)
        self.kv_spec = kv_spec or KVCacheSpec(dtype)
        self.kv_caches: KVCaches = []
        self.cpu_caches: KVCaches = []
        self.kv_scales: KVCaches = []  # quantized cache only: per layer [blocks, bs, Hkv] scales
        self.cpu_scales: KVCaches = []
        # the prefix cache's CPU tier (kv_offloading_size): its own pool beside the swap pool
        self.offload_caches: KVCaches = []
        self.offload_scales: KVCaches = []
        self.kv_connector = kv_connector
        # Pools of other owners that share the block ids (an EAGLE head's): ``block_pools(where)``
        self.block_companions: list[Any] = (
            [drafter] if drafter and drafter.moves_with_blocks else []
        )
        # Whether _run keeps each forward's final hidden states [T, H] in ``last_hidden`` (an
        # EAGLE drafter reads the target's features from them).
        self.keep_hidden = bool(drafter and drafter.reads_hidden_states)
        self.last_hidden: torch.Tensor | None = None
        # Scale pools and companions' pools share the caches' slots, so every block op moves
        # them alongside (the offload tier and KV connectors carry the caches and scales only).
        device = lambda: self.kv_caches + self.kv_scales + self._companion_pools("device")
        cpu = lambda: self.cpu_caches + self.cpu_scales + self._companion_pools("cpu")
        offload = lambda: self.offload_caches + self.offload_scales
        self._block_op_caches = {"copy": (device, device), "swap_out": (device, cpu),
                                 "swap_in": (cpu, device), "offload": (device, offload),
                                 "onload": (offload, device)}  # fmt: skip

    def _companion_pools(self, where: str) -> list[tuple[torch.Tensor, ...]]:
        return [pool for c in self.block_companions for pool in c.block_pools(where)]

    def block_bytes(self) -> int:
        """Bytes of one block of this rank's KV pools (all layers, K and V, scales)."""
        scale = SCALE_DTYPE if self.kv_spec.quantized else None
        return kv_bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim,
                                  self.block_size, self.kv_spec.dtype, scale)  # fmt: skip

    def initialize_cache(
        self, num_blocks: int, num_cpu_blocks: int, num_offload_blocks: int = 0
    ) -> None:
        """Allocate the device pool, the CPU swap pool and the prefix cache's CPU tier."""
        self.kv_caches, self.kv_scales = self._pools(num_blocks, self.device)
        self.cpu_caches, self.cpu_scales = self._pools(num_cpu_blocks, "cpu")
        self.offload_caches, self.offload_scales = self._pools(num_offload_blocks, "cpu")

    def _pools(self, num_blocks: int, device: torch.device | str) -> tuple[KVCaches, KVCaches]:
        """K/V pools of ``num_blocks`` (and their scales for a quantized cache); host pools are
        pinned when the device is a GPU, for fast copies. Nothing for 0 blocks."""
        if not num_blocks:
            return [], []
        pin = str(device) == "cpu" and self.device.type == "cuda"
        shape_args = (self.block_size, self.num_kv_heads, self.head_dim, self.kv_spec.dtype)
        caches = allocate_kv_caches(self.num_layers, num_blocks, *shape_args, device, pin)
        if not self.kv_spec.quantized:
            return caches, []
        scale_args = (self.block_size, self.num_kv_heads, SCALE_DTYPE)
        return caches, allocate_kv_scales(self.num_layers, num_blocks, *scale_args, device, pin)

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted sequence's sampler (and pooler) state."""
        self.sampler.forget(request_id)
        self.table_rows.forget(request_id)
        if self.pooler is not None:
            self.pooler.forget(request_id)

    def _forward(
        self, out: SchedulerOutput
    ) -> tuple[HostBatch | None, list[ScheduledRequest], torch.Tensor | None, torch.Tensor | None]:
        """Move blocks, run the batch; return it, its sampling requests, their logits and the
        hidden states of its pooling rows."""
        batch, sampling = (
            flatten_batch(out.scheduled, self.table_rows) if out.scheduled else (None, [])
        )
        if self.parallel is None:
            return batch, sampling, *self.run_batch(out.block_ops, batch)
        with self.parallel.step(out.block_ops, batch):  # every other rank runs the same step
            return batch, sampling, *self.run_batch(out.block_ops, batch)

    def run_batch(
        self, block_ops: list[tuple[str, list[tuple[int, int]]]], batch: HostBatch | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Move blocks, then run ``batch``; return the logits [R + P, V] of its sample rows,
        then of its prompt-logprob rows (None without either), and the final hidden states of
        its pooling rows (None without any). Tensor-parallel ranks all call this with the same
        arguments; only rank 0's logits cover the whole vocabulary."""
        saves = self.apply_block_ops(block_ops)
        outputs = self._run(batch)
        if saves:
            self.kv_connector.save(self._transfer_pools(), saves)
        return outputs

    def apply_block_ops(
        self, block_ops: list[tuple[str, list[tuple[int, int]]]]
    ) -> list[tuple[int, int]]:
        """Copy, swap, offload and load blocks in decision order (a block may be reused within
        a step); return the KV connector's saves, which wait until the forward has run."""
        saves = []
        for kind, pairs in block_ops:
            if kind == "kv_save":  # logged last; the forward writes these blocks
                saves.extend(pairs)
            elif kind == "kv_load":
                self.kv_connector.load(self._transfer_pools(), pairs)
            else:
                src, dst = self._block_op_caches[kind]
                move_blocks(src(), dst(), pairs)
        return saves

    def _transfer_pools(self) -> dict[str, KVCaches]:
        """What a KV connector moves per block: the caches and, if quantized, their scales."""
        return {"kv": self.kv_caches, "scales": self.kv_scales}

    def _run(self, batch: HostBatch | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forward pass of ``run_batch``: logits of sample and prompt-logprob rows, hidden
        states of pooling rows."""
        self.last_hidden = None
        if batch is None:
            self.inputs_done = time.perf_counter()
            return None, None
        # Every host-to-device copy comes before the model is launched: a copy from pageable
        # memory waits for the stream, so one after the launch would wait for the whole
        # forward (and leave nothing for async output processing to overlap). The step's
        # own inputs go through pinned memory (utils.host.to_device), so under async
        # scheduling they queue behind the previous step's forward instead of waiting for it.
        key = self.cuda_graphs.key_for(batch) if self.cuda_graphs is not None else None
        if key is not None:
            # "graph": a decode graph; "graph_q5": one of query stride 5 (k = 4 verifications)
            kind = {1: "graph", VARLEN: "graph_mixed"}.get(key[1], f"graph_q{key[1]}")
            self._count_forward(kind)
            prepared = self.cuda_graphs.prepare(batch, key)
            if batch.placeholders:  # stride 1 and mixed steps: the batch's tokens lead, in order
                feed_placeholders(self.cuda_graphs.input_ids, batch.placeholders,
                                  self.last_sampled)  # fmt: skip
            head_rows, pool_rows = self._row_indices(batch)
            self.inputs_done = time.perf_counter()
            hidden = self.cuda_graphs.run(key, prepared)  # [T, hidden]
        else:
            self._count_forward("eager_decode" if is_decode_batch(batch) else "eager_prefill")
            inputs = to_step_inputs(batch, self.block_size, self.device, self.backend)
            if batch.placeholders:  # async scheduling: tokens still on the device
                feed_placeholders(inputs.input_ids, batch.placeholders, self.last_sampled)
            head_rows, pool_rows = self._row_indices(batch)
            ctx = ForwardContext(
                inputs.attn_metadata, self.backend, self.kv_caches, self.kv_scales or None
            )
            if self.lora is not None:
                self.lora.activate(batch.lora_ids, batch.query_lens)
            self.inputs_done = time.perf_counter()
            try:
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # [T, hidden]
            finally:
                if self.lora is not None:
                    self.lora.deactivate()
        if self.keep_hidden:
            self.last_hidden = hidden
        pooled = hidden[pool_rows] if pool_rows is not None else None  # [rows, H]
        if head_rows is None:
            return None, pooled
        return self.model.compute_logits(hidden[head_rows]), pooled  # [R + P, V]

    def _row_indices(self, batch: HostBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Device indices of the rows whose logits are needed (sample rows, then prompt-
        logprob rows; [R + P]) and of the pooling rows, None where there are none."""
        rows = batch.sample_rows + batch.prompt_rows
        pool = [r for _, first, _, n, _ in batch.pool_spans for r in range(first, first + n)]
        return tuple(to_device(int_tensor(r), self.device) if r else None for r in (rows, pool))  # type: ignore[return-value]

    def _count_forward(self, kind: str) -> None:
        self.forward_kinds[kind] += 1
        self.last_forward_kind = kind

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        draft_probs: dict[str, torch.Tensor] | None = None,
        while_running: Any = None,
        defer: bool = False,
    ) -> tuple[
        dict[str, SampleResult], dict[str, PromptLogprobs], dict[str, torch.Tensor],
        DeferredTokens | None,
    ]:  # fmt: skip
        """Run one step: move blocks, forward the batch, sample (or verify drafts) where due.
        ``while_running()`` runs once the forward is launched, before sampling waits for it.

        ``draft_probs`` holds the drafter's distributions [k, V] for requests whose drafts came
        from a model; drafts without one are treated as deterministic proposals. Also returns
        the prompt logprobs this step computed, and the pooled outputs of the pooling requests
        whose prompt it completed, by request id. With ``defer`` (async scheduling) and
        requests that ``can_defer``, the sampled ids stay on the device: the results and the
        prompt logprobs are empty and the last value carries them (``DeferredTokens``);
        otherwise it is None.
        """
        batch, sampling, logits, pool_hidden = self._forward(out)
        # read by this step's inputs and, for penalties, its sampling only
        previous, self.last_sampled = self.last_sampled, None
        pending = previous.token_of if previous is not None else None
        self.model_done = time.perf_counter()  # launched (CPU: computed); sampling waits for it
        if while_running is not None:  # host work beside the device's (async output processing)
            while_running()
        pooled = {}
        if pool_hidden is not None:
            params = {s.request.request_id: s.request.pooling_params for s in out.scheduled}
            pooled = self.pooler.update(pool_hidden, batch.pool_spans, params)
        if logits is None:
            return {}, {}, pooled, None
        num_sample_rows = len(batch.sample_rows)
        prompt_rows, logits = logits[num_sample_rows:], logits[:num_sample_rows]
        requests = [s.request for s in sampling]
        if defer and requests and can_defer(requests):
            logits = logits.float()
            # a CPU computes as the host asks, so waiting on it costs nothing (and its
            # top-p path that may wait is the faster one)
            ids = self.sampler.sample_ids(logits, requests, logits.device.type == "cpu", pending)
            prompt = pack_prompt_logprobs(prompt_rows, batch)  # copied with the ids
            self.last_sampled = DeferredTokens.start(requests, ids, logits, prompt)
            self.deferred_steps += 1
            return {}, {}, pooled, self.last_sampled
        sampled = self._sample(logits, sampling, batch, draft_probs, pending)
        # a step whose requests asked for no prompt logprobs has no rows for them
        prompt = prompt_logprobs(prompt_rows, batch) if batch.prompt_rows else {}
        return sampled, prompt, pooled, None

    def _sample(
        self,
        logits: torch.Tensor,  # [R, V]: the batch's sample rows
        sampling: list[ScheduledRequest],
        batch: HostBatch,
        draft_probs: dict[str, torch.Tensor] | None,
        pending: PendingTokens | None = None,
    ) -> dict[str, SampleResult]:
        """Sample each request's token, or verify its drafts, and bring them to the host."""
        results: dict[str, SampleResult] = {}
        plain_rows, plain, greedy_verifies = [], [], []
        row = 0
        for s, n_rows in zip(sampling, batch.rows_per_request):
            req = s.request
            if req.spec_token_ids and self.sampler.verifies_plainly(req):
                greedy_verifies.append((req, row, n_rows))
            elif req.spec_token_ids:
                results[req.request_id] = self.sampler.verify(
                    logits[row : row + n_rows], req, req.spec_token_ids,
                    (draft_probs or {}).get(req.request_id),
                )  # fmt: skip
            else:
                plain_rows.append(row)
                plain.append(req)
            row += n_rows
        if greedy_verifies:
            results.update(self.sampler.verify_plain_greedy(logits, greedy_verifies))
        if plain:  # indexing by a host list copies it to the device: skip it when it is all
            every = len(plain_rows) == logits.shape[0]
            sampled = self.sampler(logits if every else logits[plain_rows], plain, pending)
            results.update((req.request_id, r) for req, r in zip(plain, sampled))
        return results

    @torch.inference_mode()
    def execute_logprobs(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run one step and return each due request's next-token log-probabilities [V] (CPU),
        leaving the choice of token to the caller (beam search)."""
        _, sampling, logits, _ = self._forward(out)
        if logits is None:
            return {}
        rows = logits.float().log_softmax(-1).cpu()
        return {s.request.request_id: rows[i] for i, s in enumerate(sampling)}
