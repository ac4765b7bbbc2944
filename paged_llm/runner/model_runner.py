"""Turns a SchedulerOutput into tensors, runs the model over the paged cache, and samples.

The optional parts it is built with (runner/collaborators.py: tensor parallelism, LoRA, a
pooler, a KV connector, a drafter) are chosen at construction; a step calls only what they
replace (``step_scope``, ``adapters``, ``choose_tokens``). Its KV pools and block moves are
runner/kv_cache.py's ``RunnerKVPools``, its calls between steps runner/controls.py's."""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any

import torch
from torch import nn

from paged_llm.attention.base import AttentionBackend
from paged_llm.core.scheduler import ScheduledRequest, SchedulerOutput
from paged_llm.layers.attention import ForwardContext
from paged_llm.quant.kv_cache import KVCacheSpec
from paged_llm.runner.async_tokens import (
    DeferredTokens,
    can_defer,
    feed_placeholders,
    sample_deferred,
)
from paged_llm.runner.batch import (
    BlockTableRows,
    HostBatch,
    flatten_batch,
    int_tensor,
    is_decode_batch,
    to_device,
    to_step_inputs,
)
from paged_llm.runner.collaborators import (
    KVConnectorWorker,
    LoRAAdapters,
    PoolerState,
    TensorParallelStep,
    TokenChooser,
)
from paged_llm.runner.controls import RunnerControls
from paged_llm.runner.cuda_graphs import graph_kind
from paged_llm.runner.kv_cache import RunnerKVPools
from paged_llm.runner.logprobs import PromptLogprobs, prompt_logprobs
from paged_llm.runner.sampler import PendingTokens, Sampler, SampleResult
from paged_llm.spec.base import Drafter
from paged_llm.spec.verify import DraftVerifier


def no_scope(*_: Any) -> contextlib.nullcontext[None]:
    """The step scope of a feature that is off: nothing around the forward."""
    return contextlib.nullcontext()


class ModelRunner(RunnerKVPools, RunnerControls):
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
        parallel: TensorParallelStep | None = None,  # rank 0 of a TP world
        lora: LoRAAdapters | None = None,  # when LoRA is enabled
        pooler: PoolerState | None = None,  # for a pooling model
        kv_connector: KVConnectorWorker | None = None,  # kv_transfer_config's (worker side)
        drafter: Drafter | None = None,  # its flags say what the runner does for it
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
        # What the optional parts replace in a step: the scope every rank runs it in, the
        # adapters active for the forward, how tokens are chosen, who forgets a request
        self.step_scope = parallel.step if parallel is not None else no_scope
        self.adapters = lora.active if lora is not None else no_scope
        self.choose_tokens: TokenChooser = (
            DraftVerifier(self.sampler) if drafter is not None else self._sample
        )
        self.forgetters = [self.sampler.forget, self.table_rows.forget]
        self.forgetters += [pooler.forget] if pooler is not None else []
        self._init_controls(drafter)  # CUDA graphs and sleep mode: runner/controls.py
        # How each forward ran (``cuda_graphs.graph_kind`` of a replay, "eager_decode",
        # "eager_prefill": any other batch, a verification included),
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
        self._init_pools(kv_spec or KVCacheSpec(dtype), drafter, kv_connector)
        # Whether _run keeps each forward's final hidden states [T, H] in ``last_hidden`` (an
        # EAGLE drafter reads the target's features from them).
        self.keep_hidden = bool(drafter and drafter.reads_hidden_states)
        self.last_hidden: torch.Tensor | None = None

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted sequence's sampler (and pooler) state."""
        for forget in self.forgetters:
            forget(request_id)

    def _forward(
        self, out: SchedulerOutput
    ) -> tuple[HostBatch | None, list[ScheduledRequest], torch.Tensor | None, torch.Tensor | None]:
        """Move blocks, run the batch; return it, its sampling requests, their logits and the
        hidden states of its pooling rows."""
        batch, sampling = (
            flatten_batch(out.scheduled, self.table_rows) if out.scheduled else (None, [])
        )
        with self.step_scope(out.block_ops, batch):  # every other TP rank runs the same step
            return batch, sampling, *self.run_batch(out.block_ops, batch)

    def run_batch(
        self, block_ops: list[tuple[str, list[tuple[int, int]]]], batch: HostBatch | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Move blocks, then run ``batch``; return the logits [R + P, V] of its sample rows,
        then of its prompt-logprob rows (None without either), and the final hidden states of
        its pooling rows (None without any). Tensor-parallel ranks all call this with the same
        arguments; only rank 0's logits cover the whole vocabulary."""
        saves = self.apply_block_ops(block_ops) if block_ops else []
        outputs = self._run(batch)
        if saves:
            self.save_blocks(saves)
        return outputs

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
        # own inputs go through pinned memory (runner.batch.to_device), so under async
        # scheduling they queue behind the previous step's forward instead of waiting for it.
        key = self.cuda_graphs.key_for(batch) if self.cuda_graphs is not None else None
        if key is not None:
            self._count_forward(graph_kind(key))
            launch = self.cuda_graphs.load_step(batch, key, self.last_sampled)
        else:
            self._count_forward("eager_decode" if is_decode_batch(batch) else "eager_prefill")
            launch = self._load_eager(batch)
        head_rows, pool_rows = self._row_indices(batch)
        self.inputs_done = time.perf_counter()
        hidden = launch()  # [T, hidden]
        if self.keep_hidden:
            self.last_hidden = hidden
        pooled = hidden[pool_rows] if pool_rows is not None else None  # [rows, H]
        if head_rows is None:
            return None, pooled
        return self.model.compute_logits(hidden[head_rows]), pooled  # [R + P, V]

    def _load_eager(self, batch: HostBatch) -> Any:
        """Copy the batch's inputs to the device; return the model's forward over them, with
        the batch's LoRA adapters active (``adapters``)."""
        inputs = to_step_inputs(batch, self.block_size, self.device, self.backend)
        if batch.placeholders:  # async scheduling: tokens still on the device
            feed_placeholders(inputs.input_ids, batch.placeholders, self.last_sampled)
        ctx = ForwardContext(
            inputs.attn_metadata, self.backend, self.kv_caches, self.kv_scales or None
        )

        def launch() -> torch.Tensor:
            with self.adapters(batch):
                return self.model(inputs.input_ids, inputs.positions, ctx)

        return launch

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
            self.last_sampled = sample_deferred(self.sampler, logits, requests, prompt_rows, batch,
                                                pending)  # fmt: skip
            self.deferred_steps += 1
            return {}, {}, pooled, self.last_sampled
        sampled = self.choose_tokens(logits, sampling, batch.rows_per_request, draft_probs, pending)
        # a step whose requests asked for no prompt logprobs has no rows for them
        prompt = prompt_logprobs(prompt_rows, batch) if batch.prompt_rows else {}
        return sampled, prompt, pooled, None

    def _sample(
        self,
        logits: torch.Tensor,  # [R, V]: the batch's sample rows, one per request
        sampling: list[ScheduledRequest],
        rows_per_request: list[int],  # all 1: without a drafter no request has drafts
        draft_probs: dict[str, torch.Tensor] | None,
        pending: PendingTokens | None = None,
    ) -> dict[str, SampleResult]:
        """Sample each request's token and bring them to the host (``choose_tokens`` without
        a drafter)."""
        requests = [s.request for s in sampling]
        sampled = self.sampler(logits, requests, pending)
        return {req.request_id: r for req, r in zip(requests, sampled)}

    @torch.inference_mode()
    def execute_logprobs(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run one step and return each due request's next-token log-probabilities [V] (CPU),
        leaving the choice of token to the caller (beam search)."""
        _, sampling, logits, _ = self._forward(out)
        if logits is None:
            return {}
        rows = logits.float().log_softmax(-1).cpu()
        return {s.request.request_id: rows[i] for i, s in enumerate(sampling)}
