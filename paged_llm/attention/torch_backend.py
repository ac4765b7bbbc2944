"""The readable reference backend: gather paged K/V with torch indexing, then attention.

Below it, the plain-torch paged-cache code it runs, shared with the reference attention, the
contiguous backend and the kernel tests: storing a step's K/V in their slots (the Triton store's
reference), reading a sequence's K/V from its blocks (dequantized for a quantized cache), and
which positions its queries see: causal, and with ``sliding_window=W`` (None: no window) the
query at position p sees p - W + 1 ... p, as transformers' ``sliding_window_causal_mask_function``
and vLLM define it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata, context_blocks
from paged_llm.quant.kv_cache import KVCacheSpec, spec_for_cache


class TorchAttentionBackend(AttentionBackend):
    """Plain torch: gather each sequence's blocks, then fused attention (the readable
    reference, and the CPU fallback where the native kernel of the cpu backend cannot build)."""

    name = "torch"
    supports_quantized_kv = True

    def __init__(self) -> None:
        # Reused gather buffers, one per (K or V, cache layout): a fresh tensor per sequence
        # and layer costs an allocation (mmap and page faults past glibc's threshold) each time.
        self._buffers: dict[tuple, torch.Tensor] = {}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store K/V, then per sequence: gather its blocks (only those inside the sliding
        window, if any), attend (decodes: two bmm calls, others: one fused SDPA call)."""
        scales = (k_scale, v_scale)  # both None unless the cache is quantized
        store_kv_reference(key, value, k_cache, v_cache, meta.slot_mapping, *scales)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        # Decodes are the first sequences, one token each; a subclass may take them all at once
        # (and short multi-token queries after them).
        first = self._decodes(query, k_cache, v_cache, meta, scale, out, *scales, sliding_window)
        if first == meta.num_seqs:
            return out
        # The step's block ids are built once (one int64 tensor for all sequences, shared by
        # every layer), so each sequence's gather is one index_select on a slice of it.
        # Gathering all sequences at once was measured slower on a CPU: the gathered context
        # falls out of cache before SDPA reads it (docs/benchmarks.md).
        ids, block_starts = context_blocks(meta, k_cache.shape[1])
        start = sum(meta.query_lens_cpu[:first])
        for b in range(first, meta.num_seqs):
            q_len, s_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
            seq_ids = ids[block_starts[b] : block_starts[b + 1]]
            # Positions before the window of the first query are never read: skip their blocks
            # (key positions shift by the same offset as the queries', so the mask is unchanged).
            skip = window_start(s_len, s_len - q_len, sliding_window) // k_cache.shape[1]
            seq_ids, s_len = seq_ids[skip:], s_len - skip * k_cache.shape[1]
            k = gather_blocks(k_cache, seq_ids, s_len, k_scale, query.dtype)
            v = gather_blocks(v_cache, seq_ids, s_len, v_scale, query.dtype)
            out[start : start + q_len] = sdpa_one_sequence(
                query[start : start + q_len], k, v, scale, sliding_window
            )
            start += q_len
        return out

    def _decodes(
        self,
        query: torch.Tensor,  # [T, Hq, D]: the step's queries, decodes first
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D]: rows of the decodes handled are written in place
        k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv]: quantized cache
        v_scale: torch.Tensor | None,
        sliding_window: int | None = None,
    ) -> int:
        """Attend the first ``meta.num_decodes`` sequences' one query token each, gathered into
        reused buffers and written straight into ``out``; return how many sequences were done
        (0 for a quantized cache, which takes the general path). Per sequence two gathers and
        two bmm calls, which on a CPU step of small sequences costs less than the per-call
        overhead it replaces."""
        num = meta.num_decodes
        if num == 0 or k_scale is not None or k_cache.dtype != query.dtype:
            return 0
        block_size = k_cache.shape[1]
        ids, block_starts = context_blocks(meta, block_size)
        hq, d = query.shape[1:]
        hkv = k_cache.shape[2]
        most = max(block_starts[b + 1] - block_starts[b] for b in range(num))
        k_buf, v_buf = self._buffer(k_cache, 0, most), self._buffer(v_cache, 1, most)
        queries = query[:num].view(-1, hkv, hq // hkv, d)  # a KV head's query-head group as rows
        outs = out[:num].view(-1, hkv, hq // hkv, d)
        for b in range(num):
            s_len = meta.seq_lens_cpu[b]
            lo = window_start(s_len, s_len - 1, sliding_window)  # first position the token sees
            skip = lo // block_size
            seq_ids = ids[block_starts[b] + skip : block_starts[b + 1]]
            n, local_len = seq_ids.shape[0], s_len - skip * block_size
            k = gather_blocks(k_cache, seq_ids, local_len, out=k_buf[:n])[lo % block_size :]
            v = gather_blocks(v_cache, seq_ids, local_len, out=v_buf[:n])[lo % block_size :]
            decode_one_sequence_into(outs[b], queries[b], k, v, scale)
        return num

    def release_buffers(self) -> None:
        """Drop the reused gather buffers (they grow back on the next step)."""
        self._buffers.clear()

    def _buffer(self, cache: torch.Tensor, which: int, num_blocks: int) -> torch.Tensor:
        """A reused [>= num_blocks, block_size, Hkv, D] buffer shaped like ``cache``'s blocks."""
        key = (which, tuple(cache.shape[1:]), cache.dtype, cache.device)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < num_blocks:
            grown = max(num_blocks, 2 * (0 if buf is None else buf.shape[0]))
            buf = self._buffers[key] = cache.new_empty((grown, *cache.shape[1:]))
        return buf


def sdpa_one_sequence(
    q: torch.Tensor,  # [Lq, Hq, D]: the last Lq of the Lk positions
    k: torch.Tensor,  # [Lk, Hkv, D]
    v: torch.Tensor,  # [Lk, Hkv, D]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [Lq, Hq, D]
    """``attention_one_sequence`` through torch's fused scaled_dot_product_attention (decode
    queries through two batched matmuls, see ``decode_one_sequence_into``).

    A per-sequence gather of exactly its blocks plus one fused call is several times faster on
    a CPU than a padded batched gather with einsums (docs/benchmarks.md has the profile).
    """
    lq, lk = q.shape[0], k.shape[0]
    if lq == 1:
        out = torch.empty_like(q)
        grouped = (k.shape[1], -1, q.shape[2])  # [Hkv, G, D]
        if sliding_window is not None:
            k, v = k[-sliding_window:], v[-sliding_window:]
        decode_one_sequence_into(out.view(grouped), q.view(grouped), k, v, scale)
        return out
    mask = attention_mask(lq, lk, sliding_window, q.device)  # causal, aligned to the end
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return o.transpose(0, 1)


def decode_one_sequence_into(
    out: torch.Tensor,  # [Hkv, G, D]: written in place
    q: torch.Tensor,  # [Hkv, G, D]: one query token, its heads grouped by KV head
    k: torch.Tensor,  # [Lk, Hkv, D]
    v: torch.Tensor,  # [Lk, Hkv, D]
    scale: float,
) -> None:
    """One query token's attention as scores = q K^T per KV head (its query-head group as the
    rows), softmax in float32, then p V. On a CPU this is ~1.4x faster than
    scaled_dot_product_attention for one query (measured in docs/benchmarks.md)."""
    scores = torch.bmm(q, k.permute(1, 2, 0))  # [Hkv, G, Lk]
    if scores.dtype == torch.float32:
        p = torch.softmax(scores.mul_(scale), dim=-1)
    else:
        p = torch.softmax(scores.float() * scale, dim=-1).to(v.dtype)
    torch.bmm(p, v.transpose(0, 1), out=out)


def store_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, flat slot index; negative = skip (padding)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] float32: quantized cache
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K and V into ``cache.view(-1, Hkv, D)[slot]`` in place; with scale
    pools (int8 / fp8 cache) each vector is quantized and its scale stored in the same slot."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if k_scale is None:
        flat_k.index_copy_(0, slots, key[valid].to(k_cache.dtype))
        flat_v.index_copy_(0, slots, value[valid].to(v_cache.dtype))
        return
    spec = spec_for_cache(k_cache)
    for x, flat, scale in ((key, flat_k, k_scale), (value, flat_v, v_scale)):
        codes, s = spec.quantize(x[valid])
        flat[slots] = codes  # index_put: index_copy_ has no float8 kernel on the CPU
        scale.view(-1, scale.shape[-1])[slots] = s


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    ids: torch.Tensor,  # [ceil(seq_len / block_size)] int64: exactly the sequence's blocks
    seq_len: int,
    scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    dtype: torch.dtype | None = None,  # dequantize (or cast) into this dtype
    out: torch.Tensor | None = None,  # [len(ids), block_size, Hkv, D]: a reused gather buffer
) -> torch.Tensor:
    """The first ``seq_len`` cached vectors of one sequence, from exactly its block ids as an
    int64 tensor: [seq_len, Hkv, D] (dequantized when the cache comes with scales; no table
    slicing or conversion: the torch backend's per-layer hot path)."""
    vectors = torch.index_select(cache, 0, ids, out=out).flatten(0, 1)[:seq_len]
    if scale is None:
        return vectors if dtype is None else vectors.to(dtype)
    scales = scale.index_select(0, ids).flatten(0, 1)[:seq_len]
    return KVCacheSpec.dequantize(vectors, scales, dtype or torch.float32)


def attention_mask(
    lq: int, lk: int, sliding_window: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[Lq, Lk] bool, True where a query (the last Lq of Lk positions) may attend to a key:
    causal, and within the sliding window when there is one."""
    q_pos = torch.arange(lk - lq, lk, device=device)[:, None]
    k_pos = torch.arange(lk, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def window_start(seq_len: int, first_query_pos: int, sliding_window: int | None) -> int:
    """First context position any query at or after ``first_query_pos`` can see (0 without a
    window); earlier positions are never read again."""
    if sliding_window is None:
        return 0
    return min(seq_len, max(0, first_query_pos - sliding_window + 1))
