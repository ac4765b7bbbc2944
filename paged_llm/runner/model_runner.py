"""Turns a SchedulerOutput into tensors, runs the model over the paged cache, and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata, build_attention_metadata
from paged_llm.core.scheduler import ScheduledRequest, SchedulerOutput
from paged_llm.layers.attention import ForwardContext
from paged_llm.quant.kv_cache import SCALE_DTYPE, KVCacheSpec
from paged_llm.runner.kv_cache import KVCaches, allocate_kv_caches, allocate_kv_scales, move_blocks
from paged_llm.runner.sampler import Sampler, SampleResult

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """The flattened batch of one step (decodes first)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64: rows of T whose logits are needed
    sampling: list[ScheduledRequest]  # the requests that sample this step, in row order
    rows_per_request: list[int]  # 1, or 1 + number of draft tokens to verify


def order_for_backend(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Put single-token queries (decodes) first, as AttentionMetadata requires."""
    return [s for s in scheduled if s.num_new_tokens == 1] + [
        s for s in scheduled if s.num_new_tokens != 1
    ]


def prepare_inputs(
    scheduled: list[ScheduledRequest], block_size: int, device: torch.device
) -> StepInputs:
    """Gather token ids, positions, slots and block tables for the scheduled requests."""
    ordered = order_for_backend(scheduled)
    ids: list[int] = []
    positions: list[int] = []
    query_lens, seq_lens, tables, rows, sampling, per_req = [], [], [], [], [], []
    for s in ordered:
        req, start = s.request, s.request.num_computed_tokens
        end = start + s.num_new_tokens
        ids.extend((req.all_token_ids + req.spec_token_ids)[start:end])
        positions.extend(range(start, end))
        query_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        tables.append(s.block_table)
        if s.samples:
            n_rows = 1 + len(req.spec_token_ids)  # verify each draft, plus one more token
            rows.extend(range(len(ids) - n_rows, len(ids)))
            sampling.append(s)
            per_req.append(n_rows)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, device)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn_metadata=meta,
        sample_rows=torch.tensor(rows, dtype=torch.long, device=device),
        sampling=sampling,
        rows_per_request=per_req,
    )


class ModelRunner:
    """Owns the model, its KV pools (device and swap) and the sampler."""

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
        self.kv_spec = kv_spec or KVCacheSpec(dtype)
        self.kv_caches: KVCaches = []
        self.cpu_caches: KVCaches = []
        self.kv_scales: KVCaches = []  # quantized cache only: per layer [blocks, bs, Hkv] scales
        self.cpu_scales: KVCaches = []
        # Scale pools share the caches' slots, so every block op moves them alongside.
        device = lambda: self.kv_caches + self.kv_scales
        cpu = lambda: self.cpu_caches + self.cpu_scales
        self._block_op_caches = {"copy": (device, device), "swap_out": (device, cpu),
                                 "swap_in": (cpu, device)}  # fmt: skip

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the device pool and the CPU swap pool."""
        shape_args = (self.block_size, self.num_kv_heads, self.head_dim, self.kv_spec.dtype)
        self.kv_caches = allocate_kv_caches(self.num_layers, num_blocks, *shape_args, self.device)
        pin = self.device.type == "cuda"
        if num_cpu_blocks:
            self.cpu_caches = allocate_kv_caches(
                self.num_layers, num_cpu_blocks, *shape_args, "cpu", pin_memory=pin
            )
        if self.kv_spec.quantized:
            scale_args = (self.block_size, self.num_kv_heads, SCALE_DTYPE)
            self.kv_scales = allocate_kv_scales(
                self.num_layers, num_blocks, *scale_args, self.device
            )
            if num_cpu_blocks:
                self.cpu_scales = allocate_kv_scales(
                    self.num_layers, num_cpu_blocks, *scale_args, "cpu", pin_memory=pin
                )

    def _forward(self, out: SchedulerOutput) -> tuple[StepInputs | None, torch.Tensor | None]:
        """Move blocks, run the batch; return inputs and logits [N, V] of sampling requests."""
        for kind, pairs in out.block_ops:  # in decision order: a block may be reused in a step
            src, dst = self._block_op_caches[kind]
            move_blocks(src(), dst(), pairs)
        if not out.scheduled:
            return None, None
        inputs = prepare_inputs(out.scheduled, self.block_size, self.device)
        ctx = ForwardContext(
            inputs.attn_metadata, self.backend, self.kv_caches, self.kv_scales or None
        )
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # [T, hidden]
        if not inputs.sampling:
            return inputs, None
        return inputs, self.model.compute_logits(hidden[inputs.sample_rows])  # [N, V]

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        banned: dict[str, list[int]] | None = None,
        draft_probs: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, SampleResult]:
        """Run one step: move blocks, forward the batch, sample (or verify drafts) where due.

        ``draft_probs`` holds the drafter's distributions [k, V] for requests whose drafts came
        from a model; drafts without one are treated as deterministic proposals.
        """
        inputs, logits = self._forward(out)
        if logits is None:
            return {}
        results: dict[str, SampleResult] = {}
        plain_rows, plain = [], []
        row = 0
        for s, n_rows in zip(inputs.sampling, inputs.rows_per_request):
            req = s.request
            ban = (banned or {}).get(req.request_id, [])
            if req.spec_token_ids:
                results[req.request_id] = self.sampler.verify(
                    logits[row : row + n_rows], req.request_id, req.sampling_params,
                    req.spec_token_ids, (draft_probs or {}).get(req.request_id), ban,
                )  # fmt: skip
            else:
                plain_rows.append(row)
                plain.append((req.request_id, req.sampling_params, ban))
            row += n_rows
        if plain:
            ids, params, bans = map(list, zip(*plain))
            sampled = self.sampler(logits[plain_rows], ids, params, bans)
            results.update(zip(ids, sampled))
        return results

    @torch.inference_mode()
    def execute_logprobs(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run one step and return each due request's next-token log-probabilities [V] (CPU),
        leaving the choice of token to the caller (beam search)."""
        inputs, logits = self._forward(out)
        if logits is None:
            return {}
        rows = logits.float().log_softmax(-1).cpu()
        return {s.request.request_id: rows[i] for i, s in enumerate(inputs.sampling)}
