"""Torch reference for paged attention: gather each sequence's K/V through its block table,
then plain causal softmax attention in float32. Readable first; every kernel is tested
against this. The block gather and the causal / sliding-window mask are the torch
backend's (attention/torch_backend.py).
"""

from __future__ import annotations

import torch

from paged_llm.attention.torch_backend import attention_mask, gather_blocks
from paged_llm.quant.kv_cache import KVCacheSpec

__all__ = [  # attention_mask is read from here too (torch_backend.py has it)
    "attention_mask", "attention_one_sequence", "gather_kv", "paged_attention_reference",
    "paged_decode_attention_batched",
]  # fmt: skip


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int
    seq_len: int,
    scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    dtype: torch.dtype | None = None,  # dequantize into this dtype (default float32)
) -> torch.Tensor:
    """Return the first ``seq_len`` cached vectors of one sequence: [seq_len, Hkv, D]
    (dequantized when the cache comes with scales)."""
    num_blocks = (seq_len + cache.shape[1] - 1) // cache.shape[1]
    return gather_blocks(cache, block_table[:num_blocks].long(), seq_len, scale, dtype)


def attention_one_sequence(
    q: torch.Tensor,  # [Lq, Hq, D]
    k: torch.Tensor,  # [Lk, Hkv, D]
    v: torch.Tensor,  # [Lk, Hkv, D]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention where the Lq queries are the last Lq of the Lk positions: [Lq, Hq, D]."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1).float()  # [Lk, Hq, D]
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, Lq, Lk]
    scores = scores.masked_fill(~attention_mask(lq, lk, sliding_window, q.device), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_lens: list[int],  # [B]
    seq_lens: list[int],  # [B], context length including the query tokens
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's query tokens over its paged context: [T, Hq, D]."""
    out = torch.empty_like(query)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        k = gather_kv(k_cache, block_tables[b], s_len, k_scale, query.dtype).to(query.dtype)
        v = gather_kv(v_cache, block_tables[b], s_len, v_scale, query.dtype).to(query.dtype)
        out[start : start + q_len] = attention_one_sequence(
            query[start : start + q_len], k, v, scale, sliding_window
        )
        start += q_len
    return out


def paged_decode_attention_batched(
    query: torch.Tensor,  # [B, Hq, D], one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention for a whole batch at once (padded gather + mask): [B, Hq, D].

    Same math as ``paged_attention_reference`` with query length 1; it avoids a Python loop
    over sequences, which is what makes the torch backend usable on a CPU.
    """
    bsz, hq, dim = query.shape
    _, block_size, hkv, _ = k_cache.shape
    k = k_cache[block_tables.long()].reshape(bsz, -1, hkv, dim)  # [B, S, Hkv, D]
    v = v_cache[block_tables.long()].reshape(bsz, -1, hkv, dim)
    if k_scale is not None:  # quantized cache: [B, S, Hkv] scales gathered alike
        tables = block_tables.long()
        k = KVCacheSpec.dequantize(k, k_scale[tables].reshape(bsz, -1, hkv), query.dtype)
        v = KVCacheSpec.dequantize(v, v_scale[tables].reshape(bsz, -1, hkv), query.dtype)
    group = hq // hkv
    q = query.float().view(bsz, hkv, group, dim)
    scores = torch.einsum("bhgd,bshd->bhgs", q, k.float()) * scale  # [B, Hkv, G, S]
    pos = torch.arange(k.shape[1], device=query.device)
    lens = seq_lens[:, None].to(pos.dtype)
    mask = pos[None, :] >= lens  # [B, S]
    if sliding_window is not None:
        mask |= pos[None, :] <= lens - 1 - sliding_window
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    v = v.float().masked_fill(mask[:, :, None, None], 0.0)  # unused slots may hold NaN/garbage
    out = torch.einsum("bhgs,bshd->bhgd", probs, v)
    return out.reshape(bsz, hq, dim).to(query.dtype)
