"""Reading one sequence's K/V out of the paged cache (through its block table, dequantized when
the cache is quantized) and which context positions its queries see (causal, within a sliding
window when there is one). The torch backend and the reference attention both use them.

Sliding window (Mistral, Qwen2/3 with ``use_sliding_window``): with ``sliding_window=W`` the
query at position p attends to the W positions p - W + 1 ... p (itself included), as
transformers' ``sliding_window_causal_mask_function`` and vLLM define it. ``None`` = no window.
"""

from __future__ import annotations

import torch

from paged_llm.quant.kv_cache import KVCacheSpec


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


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    ids: torch.Tensor,  # [ceil(seq_len / block_size)] int64: exactly the sequence's blocks
    seq_len: int,
    scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    dtype: torch.dtype | None = None,  # dequantize (or cast) into this dtype
    out: torch.Tensor | None = None,  # [len(ids), block_size, Hkv, D]: a reused gather buffer
) -> torch.Tensor:
    """``gather_kv`` from the sequence's block ids as an int64 tensor (no table slicing or
    conversion: the torch backend's per-layer hot path): [seq_len, Hkv, D]."""
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
