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
from paged_llm.runner.kv_cache import KVCaches, allocate_kv_caches, move_blocks
from paged_llm.runner.sampler import Sampler, SampleResult

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """The flattened batch of one step (decodes first)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [N] int64: index in T of each sampling request's last token
    sampling: list[ScheduledRequest]  # the N requests that sample this step, in row order


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
    query_lens, seq_lens, tables, rows, sampling = [], [], [], [], []
    for s in ordered:
        req, start = s.request, s.request.num_computed_tokens
        end = start + s.num_new_tokens
        ids.extend(req.all_token_ids[start:end])
        positions.extend(range(start, end))
        query_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        tables.append(s.block_table)
        if s.samples:
            rows.append(len(ids) - 1)
            sampling.append(s)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, device)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn_metadata=meta,
        sample_rows=torch.tensor(rows, dtype=torch.long, device=device),
        sampling=sampling,
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
        self.kv_caches: KVCaches = []
        self.cpu_caches: KVCaches = []

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the device pool and the CPU swap pool."""
        shape_args = (self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        self.kv_caches = allocate_kv_caches(self.num_layers, num_blocks, *shape_args, self.device)
        if num_cpu_blocks:
            pin = self.device.type == "cuda"
            self.cpu_caches = allocate_kv_caches(
                self.num_layers, num_cpu_blocks, *shape_args, "cpu", pin_memory=pin
            )

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, banned: dict[str, list[int]] | None = None
    ) -> dict[str, SampleResult]:
        """Run one step: move swapped blocks, forward the batch, sample where due."""
        move_blocks(self.kv_caches, self.cpu_caches, out.swap_out)  # before their reuse
        move_blocks(self.cpu_caches, self.kv_caches, out.swap_in)
        if not out.scheduled:
            return {}
        inputs = prepare_inputs(out.scheduled, self.block_size, self.device)
        ctx = ForwardContext(inputs.attn_metadata, self.backend, self.kv_caches)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # [T, hidden]
        if not inputs.sampling:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # [N, V]
        ids = [s.request.request_id for s in inputs.sampling]
        params = [s.request.sampling_params for s in inputs.sampling]
        bans = [(banned or {}).get(rid, []) for rid in ids]
        results = self.sampler(logits, ids, params, bans)
        return dict(zip(ids, results))
