"""CUDA graphs for decode steps (vLLM's scheme): capture the model's forward pass once per
batch-size bucket, then replay it for steps where every sequence decodes one token.

Why: a decode step of a 7B model launches hundreds of small kernels; at small batches the
launches, not the GPU, set the pace. A replayed graph launches them all in one call.

How:
* buckets 1, 2, 4, 8, 16, 24, ... (multiples of 8) up to ``max_num_seqs`` (at most 256, plus
  ``max_num_seqs`` itself when it is not a bucket); a batch runs in the smallest bucket >= it;
* static input buffers sized for the largest bucket: token ids, positions, slot mapping,
  context lengths, block tables ``[max_bucket, ceil(max_model_len / block_size)]``;
* rows past the real batch are padding: slot -1 (the KV store skips it), context length 0
  (decode attention reads nothing and writes zeros), token 0 at position 0; their outputs are
  dropped;
* graphs are captured after the KV pools exist (a graph bakes in their addresses), largest
  bucket first, sharing one memory pool; each capture is preceded by an eager warm-up run so
  Triton compiles its kernels outside the capture;
* the LM head and sampling stay eager (they only see the real rows).

Graphs are used only on CUDA, without ``enforce_eager``, at tensor_parallel_size 1 (capturing
NCCL collectives is not verified here) and with the triton backend, whose decode path reads
only device tensors and host values fixed at capture. Everything else runs exactly as before.

Measured on an H200 (paper_repro/gpu_results.md): parity with transformers through replayed
graphs, and 1,457 of 1,465 end-to-end steps replayed (run 11).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata, device_block_table
from paged_llm.layers.attention import ForwardContext

logger = logging.getLogger(__name__)

# Backends whose decode path is graph-safe: no host syncs, no per-step host-side values.
GRAPH_SAFE_BACKENDS = frozenset({"triton"})
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch buckets to capture: 1, 2, 4, then multiples of 8, up to min(max_num_seqs, limit)."""
    top = min(max_num_seqs, limit)
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8))
    sizes.add(top)  # so every batch the scheduler can build (up to the limit) has a bucket
    return sorted(s for s in sizes if s >= 1)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` sequences (None: too big for any)."""
    return next((s for s in sizes if s >= num_seqs), None)


def cuda_graph_sizes(
    device: torch.device,
    enforce_eager: bool,
    backend: AttentionBackend,
    tensor_parallel_size: int,
    max_num_seqs: int,
    enable_lora: bool = False,
) -> list[int]:
    """Buckets to capture for this engine; [] means run every step eagerly (always on CPU)."""
    if device.type != "cuda" or enforce_eager:
        return []
    reason = None
    if tensor_parallel_size > 1:
        reason = "tensor_parallel_size > 1 (capturing NCCL collectives is not verified)"
    elif enable_lora:
        reason = "LoRA is enabled (each step maps tokens to adapters anew)"
    elif backend.name not in GRAPH_SAFE_BACKENDS:
        reason = f"the '{backend.name}' attention backend reads per-step host values"
    if reason:
        logger.info("CUDA graphs off: %s", reason)
        return []
    return capture_sizes(max_num_seqs)


@dataclass
class PaddedDecode:
    """Host copies of one padded decode batch, ``bucket`` rows each."""

    input_ids: list[int]  # [bucket]
    positions: list[int]  # [bucket]
    slot_mapping: list[int]  # [bucket], -1 for padding rows
    seq_lens: list[int]  # [bucket], 0 for padding rows
    block_tables: list[list[int]]  # [bucket][width], zero-padded


def is_decode_batch(batch: Any) -> bool:
    """True when every sequence of the HostBatch feeds exactly one token (a pure decode)."""
    return bool(batch.query_lens) and all(q == 1 for q in batch.query_lens)


def pad_decode_batch(batch: Any, bucket: int, block_size: int, width: int) -> PaddedDecode:
    """Pad a pure-decode HostBatch to ``bucket`` rows and its block tables to ``width``."""
    n = len(batch.query_lens)
    if not is_decode_batch(batch) or n > bucket:
        raise ValueError(f"need a decode batch of at most {bucket} sequences, got {n}")
    if any(len(t) > width for t in batch.block_tables):
        raise ValueError(f"a block table is wider than the captured {width} blocks")
    pad = bucket - n
    slots = [
        table[pos // block_size] * block_size + pos % block_size
        for pos, table in zip(batch.positions, batch.block_tables)
    ]
    tables = [device_block_table(t) + [0] * (width - len(t)) for t in batch.block_tables]
    tables += [[0] * width] * pad
    return PaddedDecode(
        input_ids=list(batch.input_ids) + [0] * pad,
        positions=list(batch.positions) + [0] * pad,
        slot_mapping=slots + [-1] * pad,
        seq_lens=list(batch.seq_lens) + [0] * pad,
        block_tables=tables,
    )


class CudaGraphRunner:
    """Static buffers, one captured graph per bucket, and replay of fitting decode steps."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None,
        sizes: list[int],
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.kv_caches, self.kv_scales = kv_caches, kv_scales
        self.sizes = sorted(sizes)
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        self.width = -(-max_model_len // block_size)  # blocks of the longest allowed sequence
        top = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.slot_mapping = torch.full((top,), -1, **i64)
        self.seq_lens = torch.zeros(top, **i32)
        self.block_tables = torch.zeros(top, self.width, **i32)
        self.query_start_loc = torch.arange(top + 1, **i32)  # one query token per sequence
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> static hidden states [b, H]

    def _context(self, b: int) -> ForwardContext:
        """A decode-only step of b sequences reading the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # fixes the decode kernel's split-K at capture
            num_decodes=b,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b,  # only its length (b) is read here
        )
        return ForwardContext(meta, self.backend, self.kv_caches, self.kv_scales)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, in one shared memory pool."""
        start = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):
            ctx = self._context(b)
            # Padding everywhere (slot -1, length 0): the warm-up and capture touch no KV.
            self.model(self.input_ids[:b], self.positions[:b], ctx)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model(self.input_ids[:b], self.positions[:b], ctx)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (batch %d-%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)  # fmt: skip

    def can_replay(self, batch: Any) -> bool:
        """True for a pure-decode HostBatch that fits a bucket and the static block tables."""
        return (
            is_decode_batch(batch)
            and len(batch.query_lens) <= self.sizes[-1]
            and all(len(t) <= self.width for t in batch.block_tables)
        )

    def load(self, batch: Any) -> int:
        """Copy a decode HostBatch, padded, into the static buffers; return its bucket."""
        b = bucket_for(len(batch.query_lens), self.sizes)
        padded = pad_decode_batch(batch, b, self.block_size, self.width)
        for buf, values in (
            (self.input_ids, padded.input_ids),
            (self.positions, padded.positions),
            (self.slot_mapping, padded.slot_mapping),
            (self.seq_lens, padded.seq_lens),
        ):
            buf[:b].copy_(torch.tensor(values, dtype=buf.dtype))
        self.block_tables[:b].copy_(torch.tensor(padded.block_tables, dtype=torch.int32))
        return b

    def replay(self, batch: Any) -> torch.Tensor:  # -> [n, H], a view valid until next replay
        """Load the batch, replay its bucket's graph, return the real rows' hidden states."""
        b = self.load(batch)
        self.graphs[b].replay()
        return self.outputs[b][: len(batch.query_lens)]
