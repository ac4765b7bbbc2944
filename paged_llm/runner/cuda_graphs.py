"""CUDA graphs for decode and speculative steps (vLLM's scheme): capture the model's forward
pass once per (batch-size bucket, query stride), then replay it for steps that fit.

Why: a decode step of a 7B model launches hundreds of small kernels; at small batches the
launches, not the GPU, set the pace. A replayed graph launches them all in one call. A
speculative verification (1 + k tokens a sequence) is as launch-bound: on the H200 an eager
one took 7 ms where a decode graph step took 0.8 ms (run 13, paper_repro/gpu_results.md).

How:
* buckets 1, 2, 4, 8, 16, 24, ... (multiples of 8) up to ``max_num_seqs`` (at most 256, plus
  ``max_num_seqs`` itself when it is not a bucket); a batch runs in the smallest bucket >= it;
* query strides: 1 (pure decodes, the decode kernel) and, with speculative decoding, k + 1
  (the prefill kernel): a batch whose queries are all 1 to k + 1 tokens long (verifications
  beside plain decodes, a draft model's catch-up) is padded to k + 1 tokens a sequence, for
  buckets of up to ``MAX_CAPTURE_TOKENS`` tokens (``pad_batch`` says how padding stays
  invisible to the real tokens);
* mixed steps (``cudagraph_mode="FULL"``, vLLM's name): any other batch of at most
  ``max_cudagraph_capture_size`` tokens and the largest bucket's sequences (prompt chunks
  beside decodes) replays a graph of key ``(tokens, VARLEN)``, tokens a multiple of 16. The
  varlen prefill kernel's launch depends only on the number of tokens and sequences, so one
  graph covers every mix: the step's tokens come first, padding tokens after them (slot -1,
  not attended: past the last query offset), padding sequences have no queries and no context
  (``pad_varlen``). Steps with prompt tokens were 41% of an H200 run's time, all eager
  (issue 39);
* static input buffers sized for the largest key: token ids, positions, slot mapping,
  context lengths, block tables ``[max_bucket, ceil((max_model_len + k) / block_size)]``;
* rows past the real batch are padding: slot -1 (the KV store skips it), context length 0 at
  stride 1 (decode attention reads nothing and writes zeros), token 0 at position 0; their
  outputs are dropped;
* graphs are captured after the KV pools exist (a graph bakes in their addresses), largest
  first, sharing one memory pool; each capture is preceded by an eager warm-up run so
  Triton compiles its kernels outside the capture;
* the LM head and sampling stay eager (they only see the real rows);
* a drafter's model (a draft model, an EAGLE head) gets graphs of its own, from its
  ``graph_inputs`` (``ModelRunner.capture_cuda_graphs``).

Graphs are used only on CUDA, without ``enforce_eager``, at tensor_parallel_size 1 (capturing
NCCL collectives is not verified here) and with an attention backend that declares
``cuda_graph_safe`` (the triton backend), whose attention reads only device tensors and host
values fixed at capture. Everything else runs exactly as before.

Measured on an H200 (paper_repro/gpu_results.md): parity with transformers through replayed
decode graphs, and 1,457 of 1,465 end-to-end steps replayed (run 11). The stride k + 1 graphs
and the drafters' were written after run 13 and are checked on the CPU only (replayed
eagerly, tests/test_gpu_check.py); docs/gpu.md has the run that measures them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import (
    AttentionMetadata,
    padded_block_tables,
    query_starts,
    slot_mapping,
)
from paged_llm.layers.attention import ForwardContext
from paged_llm.runner.async_tokens import feed_placeholders
from paged_llm.runner.batch import int_tensor, is_decode_batch, to_device

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256
# Graphs with longer query strides stop at this many tokens per step (vLLM's default limit).
MAX_CAPTURE_TOKENS = 512
# The query stride of a mixed-step key (tokens, VARLEN): sequences of any query length.
VARLEN = 0
MIXED_TOKEN_STEP = 16  # mixed-step graphs every this many tokens


def mixed_capture_tokens(max_tokens: int) -> list[int]:
    """Token buckets of mixed-step graphs: multiples of 16 up to ``max_tokens`` (floored)."""
    return list(range(MIXED_TOKEN_STEP, max_tokens + 1, MIXED_TOKEN_STEP))


def key_tokens(key: tuple[int, int]) -> int:
    """Query tokens a graph of ``key`` runs: bucket x stride, or a mixed key's tokens."""
    return key[0] if key[1] == VARLEN else key[0] * key[1]


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
    elif not backend.cuda_graph_safe:
        reason = f"the '{backend.name}' attention backend reads per-step host values"
    if reason:
        logger.info("CUDA graphs off: %s", reason)
        return []
    return capture_sizes(max_num_seqs)


@dataclass
class PaddedBatch:
    """Host copies of one batch padded to ``bucket`` sequences of ``stride`` query tokens each:
    token j of sequence i sits at row i * stride + j."""

    input_ids: list[int]  # [bucket * stride]
    positions: list[int]  # [bucket * stride]
    slot_mapping: list[int]  # [bucket * stride], -1 for padding tokens
    seq_lens: list[int]  # [bucket]
    # [rows, w] int64 (CPU), zero-padded to the widest of them: with stride 1 and in mixed
    # steps only the real sequences' rows, up to the batch's widest table (what the static
    # buffer holds past them is never read: the kernels read a sequence's blocks below its
    # context length, and padding sequences have none), so a step copies what it uses, not
    # bucket x width; with a longer stride every row of the bucket (padding sequences read block 0)
    block_tables: torch.Tensor
    rows: list[int]  # [T]: the padded row of each of the batch's tokens, in its order
    query_start_loc: list[int] | None = None  # [bucket + 1]: mixed steps (strides fix it)


def pad_batch(batch: Any, bucket: int, stride: int, block_size: int, width: int) -> PaddedBatch:
    """Pad a HostBatch whose queries are 1 to ``stride`` tokens long to ``bucket`` sequences of
    ``stride`` tokens, and its block tables (``PaddedBatch.block_tables`` says which rows and
    how wide; none may be wider than ``width``).

    Padding writes nowhere (slot -1). With stride 1 (decode graphs) padding sequences have
    context length 0, which the decode kernel reads nothing for. With a longer stride the
    prefill kernel runs, and a sequence's padding queries come after its real ones: its
    context length grows by their number, so the real queries keep their positions and,
    attending causally, never see the padding (whose outputs are dropped); a padding
    sequence is ``stride`` queries over block 0. Padding tokens repeat the sequence's last
    position, which the position tables hold.
    """
    n = len(batch.query_lens)
    if stride == 1 and not is_decode_batch(batch):
        raise ValueError(f"stride 1 needs a decode batch, got query lengths {batch.query_lens}")
    if n > bucket or not batch.query_lens or not all(1 <= q <= stride for q in batch.query_lens):
        raise ValueError(
            f"need at most {bucket} sequences of 1 to {stride} query tokens, got {batch.query_lens}"
        )
    if any(len(t) > width for t in batch.block_tables):
        raise ValueError(f"a block table is wider than the captured {width} blocks")
    pad = bucket - n
    if stride == 1:  # one token per sequence: the batch's own rows, then the padding's
        return pad_in_order(batch, pad, pad, block_size)
    real_slots = slot_mapping(batch.query_lens, batch.seq_lens, batch.block_tables, block_size)
    ids, positions, slots, rows = [], [], [], []
    first = 0
    for i, q in enumerate(batch.query_lens):
        pos = batch.positions[first : first + q]
        ids += list(batch.input_ids[first : first + q]) + [0] * (stride - q)
        positions += list(pos) + [pos[-1]] * (stride - q)
        slots += real_slots[first : first + q] + [-1] * (stride - q)
        rows += range(i * stride, i * stride + q)
        first += q
    seq_lens = [s + stride - q for s, q in zip(batch.seq_lens, batch.query_lens)]
    return PaddedBatch(
        input_ids=ids + [0] * (pad * stride),
        positions=positions + [0] * (pad * stride),
        slot_mapping=slots + [-1] * (pad * stride),
        seq_lens=seq_lens + [stride] * pad,
        block_tables=padded_block_tables(list(batch.block_tables) + [[]] * pad, width),
        rows=rows,
    )


def pad_in_order(batch: Any, pad_tokens: int, pad_seqs: int, block_size: int) -> PaddedBatch:
    """The batch's tokens and sequences keep their rows, and padding follows them: tokens 0 at
    position 0 with slot -1 (written nowhere), sequences of context length 0 (read nothing)."""
    slots = slot_mapping(batch.query_lens, batch.seq_lens, batch.block_tables, block_size)
    return PaddedBatch(
        input_ids=list(batch.input_ids) + [0] * pad_tokens,
        positions=list(batch.positions) + [0] * pad_tokens,
        slot_mapping=slots + [-1] * pad_tokens,
        seq_lens=list(batch.seq_lens) + [0] * pad_seqs,
        block_tables=padded_block_tables(batch.block_tables),
        rows=list(range(len(batch.input_ids))),
    )


def pad_varlen(batch: Any, tokens: int, num_seqs: int, block_size: int, width: int) -> PaddedBatch:
    """Pad any HostBatch to ``tokens`` query tokens and ``num_seqs`` sequences (a mixed-step
    graph's key): its tokens keep their rows and padding tokens follow (token 0 at position 0,
    slot -1: written nowhere; past the last query offset: attended by nobody, and attending to
    nothing); padding sequences have no query tokens and context length 0."""
    n, t = len(batch.query_lens), len(batch.input_ids)
    if not n or n > num_seqs or t > tokens:
        raise ValueError(f"need 1 to {num_seqs} sequences and at most {tokens} tokens, "
                         f"got {n} and {t}")  # fmt: skip
    if any(len(table) > width for table in batch.block_tables):
        raise ValueError(f"a block table is wider than the captured {width} blocks")
    padded = pad_in_order(batch, tokens - t, num_seqs - n, block_size)
    padded.query_start_loc = query_starts(batch.query_lens) + [t] * (num_seqs - n)
    return padded


class CudaGraphRunner:
    """Static buffers, one captured graph per (bucket, query stride), and replay of fitting
    steps.

    Stride 1 graphs replay pure decodes. With speculative decoding a second stride, k + 1,
    replays verification steps (and a draft model's catch-up steps): every sequence's 1 to
    k + 1 query tokens padded to k + 1, for buckets of up to ``MAX_CAPTURE_TOKENS`` tokens.
    Keys ``(tokens, VARLEN)`` (``mixed_tokens``) replay any other step of up to that many
    tokens and up to the largest bucket's sequences (``pad_varlen``).
    """

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
        strides: tuple[int, ...] = (1,),
        mixed_tokens: Sequence[int] = (),
    ) -> None:
        self.model, self.backend = model, backend
        self.kv_caches, self.kv_scales = kv_caches, kv_scales
        self.sizes = sorted(sizes)
        self.strides = sorted(set(strides))
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        # blocks of the longest allowed sequence, plus a padded verification's extra positions
        self.width = -(-(max_model_len + self.strides[-1] - 1) // block_size)
        self.keys = [(b, s) for s in self.strides for b in self.sizes
                     if s == 1 or b * s <= MAX_CAPTURE_TOKENS]  # fmt: skip
        self.mixed_sizes = sorted(set(mixed_tokens))  # token buckets of mixed steps
        self.keys += [(t, VARLEN) for t in self.mixed_sizes]
        top = self.sizes[-1]
        tokens = max(key_tokens(k) for k in self.keys)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(tokens, **i64)
        self.positions = torch.zeros(tokens, **i64)
        self.slot_mapping = torch.full((tokens,), -1, **i64)
        self.seq_lens = torch.zeros(top, **i32)
        self.block_tables = torch.zeros(top, self.width, **i32)
        # every sequence has ``stride`` query tokens, so the offsets never change
        self.query_start_loc = {s: torch.arange(0, (top + 1) * s, s, **i32) for s in self.strides}
        self.query_start_loc[VARLEN] = torch.zeros(top + 1, **i32)  # a mixed step's, loaded
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # key -> hidden [b * s, H]

    def _context(self, b: int, stride: int = 1) -> ForwardContext:
        """A step of b sequences of ``stride`` query tokens reading the static buffers (a mixed
        step: of b tokens from the largest bucket's sequences)."""
        if stride == VARLEN:
            return self._mixed_context(b)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[: b * stride],
            query_start_loc=self.query_start_loc[stride][: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=stride,  # (the triton kernels' launches depend on shapes only)
            max_seq_len=self.max_model_len,  # fixes the decode kernel's split-K at capture
            num_decodes=b if stride == 1 else 0,
            query_lens_cpu=[stride] * b,
            seq_lens_cpu=[self.max_model_len] * b,  # only its length (b) is read here
        )
        return ForwardContext(meta, self.backend, self.kv_caches, self.kv_scales)

    def _mixed_context(self, tokens: int) -> ForwardContext:
        """A mixed step of ``tokens`` tokens over the largest bucket's sequences: every
        sequence goes to the varlen prefill kernel, whose launch reads no host values."""
        top = self.sizes[-1]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.query_start_loc[VARLEN],
            seq_lens=self.seq_lens[:top],
            block_tables=self.block_tables[:top],
            max_query_len=tokens,
            max_seq_len=self.max_model_len,
            num_decodes=0,
            query_lens_cpu=[0] * top,  # only their number (top) is read here
            seq_lens_cpu=[self.max_model_len] * top,
            padded_tokens=True,  # rows past the last query offset: no sequence's
        )
        return ForwardContext(meta, self.backend, self.kv_caches, self.kv_scales)

    def run_static(self, key: tuple[int, int]) -> torch.Tensor:  # -> [tokens, H]
        """The forward pass a graph captures: the model over the static buffers of ``key``."""
        t = key_tokens(key)
        ctx = self._context(*key)
        return self.model(self.input_ids[:t], self.positions[:t], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every key, largest first, in one shared memory pool. A stride
        above 1 whose capture fails is dropped with a warning (the decode graphs stay); a
        failing stride 1 raises."""
        start = time.perf_counter()
        pool = None
        for key in sorted(self.keys, key=key_tokens, reverse=True):
            if key not in self.keys:  # its stride was dropped
                continue
            try:
                pool = self._capture_one(key, pool)
            except Exception as err:
                if key[1] == 1:
                    raise
                what = "mixed steps" if key[1] == VARLEN else f"query stride {key[1]}"
                logger.warning("capturing %s failed, those steps run eagerly: %s", what, err)
                torch.cuda.synchronize(self.device)
                self.keys = [k for k in self.keys if k[1] != key[1]]
                self.strides = [s for s in self.strides if s != key[1]]
                for k in [k for k in self.graphs if k[1] == key[1]]:
                    del self.graphs[k], self.outputs[k]
        torch.cuda.synchronize(self.device)
        mixed = [k[0] for k in self.graphs if k[1] == VARLEN]
        logger.info("captured %d CUDA graphs (batch %d-%d, query strides %s, mixed steps of "
                    "up to %d tokens) in %.1f s", len(self.graphs), self.sizes[0], self.sizes[-1],
                    self.strides, max(mixed, default=0), time.perf_counter() - start)  # fmt: skip

    def _capture_one(self, key: tuple[int, int], pool: Any) -> Any:
        """Warm up and capture the graph of ``key``; return the shared pool."""
        # Padding everywhere (slot -1): the warm-up and capture write no KV.
        self.load_padding(key)
        self.run_static(key)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[key] = self.run_static(key)
        self.graphs[key] = graph
        return graph.pool()

    def load_padding(self, key: tuple[int, int]) -> None:
        """Fill the static buffers of ``key`` with padding only (for warm-up and capture)."""
        b, s = key
        t = key_tokens(key)
        self.input_ids[:t].zero_()
        self.positions[:t].zero_()
        self.slot_mapping[:t].fill_(-1)
        if s == VARLEN:  # no sequence has a query: every attention program returns at once
            b = self.sizes[-1]
            self.query_start_loc[VARLEN].zero_()
        self.seq_lens[:b].fill_(s if s > 1 else 0)
        self.block_tables[:b].zero_()

    def key_for(self, batch: Any) -> tuple[int, int] | None:
        """The (bucket, stride) whose graph can replay this HostBatch, or None: a decode or
        verification graph where one fits, else a mixed-step graph."""
        if not batch.query_lens or any(len(t) > self.width for t in batch.block_tables):
            return None
        longest = max(batch.query_lens)
        stride = next((s for s in self.strides if s >= longest), None)
        bucket = bucket_for(len(batch.query_lens), self.sizes)
        if stride is not None and (bucket, stride) in self.graphs:
            return bucket, stride
        if bucket is None:  # more sequences than the static buffers hold
            return None
        tokens = bucket_for(len(batch.input_ids), self.mixed_sizes)
        return (tokens, VARLEN) if (tokens, VARLEN) in self.graphs else None

    def load(self, batch: Any, key: tuple[int, int]) -> list[int]:
        """Copy a HostBatch, padded, into the static buffers of ``key`` (from ``key_for``);
        return its tokens' padded rows."""
        b, s = key
        t = key_tokens(key)
        if s == VARLEN:
            b = self.sizes[-1]
            padded = pad_varlen(batch, t, b, self.block_size, self.width)
        else:
            padded = pad_batch(batch, b, s, self.block_size, self.width)
        # One host-to-device copy for all of them: a copy from pageable memory waits for the
        # stream, and a speculative step replays several graphs.
        flat = [*padded.input_ids, *padded.positions, *padded.slot_mapping, *padded.seq_lens]
        starts = padded.query_start_loc or []
        staged = torch.cat([int_tensor(flat), padded.block_tables.view(-1), int_tensor(starts)])
        staged = to_device(staged, self.device)
        rows, w = padded.block_tables.shape
        ids, pos, slots, lens, tables, starts = staged.split([t, t, t, b, rows * w, len(starts)])
        self.input_ids[:t].copy_(ids)
        self.positions[:t].copy_(pos)
        self.slot_mapping[:t].copy_(slots)
        self.seq_lens[:b].copy_(lens)
        self.block_tables[:rows, :w].copy_(tables.view(rows, w))
        if s == VARLEN:
            self.query_start_loc[VARLEN].copy_(starts)
        return padded.rows

    def launch(self, key: tuple[int, int]) -> torch.Tensor:  # -> [tokens, H]
        """Replay the graph of ``key``; its static output."""
        self.graphs[key].replay()
        return self.outputs[key]

    def replay(
        self,
        batch: Any,
        key: tuple[int, int],
        extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> torch.Tensor:  # -> [T, H]
        """Load the batch, replay the graph of ``key`` (``key_for(batch)``, not None), return
        the hidden states of the batch's tokens in its order (stride 1 and mixed steps: a view
        valid until the next replay). ``extra`` holds per-token inputs the captured model
        reads from static buffers of its own: (buffer [tokens, ...], values [T, ...]) pairs,
        copied to the batch's padded rows."""
        return self.run(key, self.prepare(batch, key, extra))

    def prepare(
        self,
        batch: Any,
        key: tuple[int, int],
        extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[int, torch.Tensor | None]:
        """``replay``'s first half: load the inputs; (tokens, their padded rows [T] or None
        when they lead in order)."""
        rows = self.load(batch, key)
        in_order = key[1] in (1, VARLEN)  # the batch's tokens lead, in its order
        index = None
        if not in_order or extra:
            index = to_device(int_tensor(rows), self.device)
        for buffer, values in extra:
            buffer[index] = values.to(buffer.dtype)
        return len(rows), None if in_order else index

    def run(self, key: tuple[int, int], prepared: tuple[int, torch.Tensor | None]) -> torch.Tensor:
        """``replay``'s second half: replay, and pick the batch's rows [T, H]."""
        num_tokens, index = prepared
        hidden = self.launch(key)
        return hidden[:num_tokens] if index is None else hidden[index]

    def load_step(
        self, batch: Any, key: tuple[int, int], last_sampled: Any
    ) -> Callable[[], torch.Tensor]:
        """The runner's step through the graph of ``key``: load the batch and, under async
        scheduling, the sampled ids of the step before (``last_sampled``: a DeferredTokens)
        over its placeholders; return the replay, which gives the batch's hidden states."""
        prepared = self.prepare(batch, key)
        if batch.placeholders:  # stride 1 and mixed steps: the batch's tokens lead, in order
            feed_placeholders(self.input_ids, batch.placeholders, last_sampled)
        return lambda: self.run(key, prepared)


def graph_kind(key: tuple[int, int]) -> str:
    """How the runner counts a replay of ``key``: "graph" (a decode graph), "graph_mixed", or
    "graph_q<stride>" (e.g. "graph_q5": query stride 5, k = 4 verifications)."""
    return {1: "graph", VARLEN: "graph_mixed"}.get(key[1], f"graph_q{key[1]}")
