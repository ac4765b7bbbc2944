"""Triton paged prefill attention over variable-length query batches.

Sequence b contributes ``Lq = query_start_loc[b + 1] - query_start_loc[b]`` query tokens that
are the LAST Lq positions of its ``seq_lens[b]`` context; the earlier positions (a cached
prefix, or earlier chunks of a chunked prefill) are already in the paged cache, as are this
step's own K/V (the backend stores them first). So pure prefill (Lq == seq_len), prefill with a
prefix and single-token queries are all the same causal kernel.

One program owns BLOCK_M consecutive queries of one sequence and one query head, and walks the
context in tiles of BLOCK_N positions looked up through the block table (see triton_decode.py).
With a sliding window of W (``SLIDING``) a query at position p sees p - W + 1 ... p, and tiles
before the window of the program's first query are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_llm.ops.paged_attention.triton_decode import (
    LOG2E,
    check_paged_inputs,
    check_tile,
    default_tile,
    dot_in_fp32,
    dot_precision,
    load_paged_tile,
    online_softmax_step,
    quantized_cache_args,
)
from paged_llm.utils.checks import check_window


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    k_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (only read when KV_QUANT)
    v_scale_ptr,
    qk_scale,
    group_size,  # query heads per KV head
    head_dim,
    window,  # sliding window W (read only when SLIDING)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    stride_s_block,  # strides of both scale pools
    stride_s_slot,
    stride_s_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_M: tl.constexpr,  # queries per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # context positions per tile (>= 16 for tl.dot)
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two (>= 16)
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # int8 / fp8 cache: dequantize tiles to the query dtype
    SLIDING: tl.constexpr,  # attend to the last ``window`` positions of each query only
):
    """Causal attention of BLOCK_M queries of one sequence and head over its paged context."""
    q_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid is sized for the longest query; shorter sequences have nothing in later blocks.
    if q_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // group_size

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = seq_len - q_len + offs_m  # each query's absolute position in the context
    tokens = (q_start + offs_m).to(tl.int64)  # rows of the flat [T, ...] batch
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if not KV_QUANT:  # compute in the cache dtype (a quantized cache comes to q's dtype instead)
        q = q.to(k_cache_ptr.dtype.element_ty)

    # Causality: nothing after this block's last query position is ever needed.
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_M)
    # Sliding window: nothing before the window of this block's first query either.
    kv_lo = 0  # first position any query of this block sees
    if SLIDING:
        kv_lo = tl.maximum(seq_len - q_len + q_block * BLOCK_M - window + 1, 0)
    kv_start = (kv_lo // BLOCK_N) * BLOCK_N
    table_ptr = block_tables_ptr + seq * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # One loop with the causal mask on every tile keeps this readable; a tuned kernel would
    # run the tiles fully left of the diagonal without the mask.
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = (pos < seq_len) & (pos >= kv_lo)  # never read blocks before the window
        k = load_paged_tile(
            k_cache_ptr, table_ptr, pos, pos_mask, kv_head, offs_d, d_mask,
            stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim, BLOCK_SIZE,
            k_scale_ptr, stride_s_block, stride_s_slot, stride_s_head, KV_QUANT,
        ).to(q.dtype)  # fmt: skip
        v = load_paged_tile(
            v_cache_ptr, table_ptr, pos, pos_mask, kv_head, offs_d, d_mask,
            stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim, BLOCK_SIZE,
            v_scale_ptr, stride_s_block, stride_s_slot, stride_s_head, KV_QUANT,
        ).to(q.dtype)  # fmt: skip
        valid = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]  # [BLOCK_M, BLOCK_N]
        if SLIDING:
            valid = valid & (pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = online_softmax_step(
            q, k, v, valid, acc, m_i, l_i, qk_scale, DOT_FP32, DOT_PRECISION
        )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [T, Hq, D], sequences' query tokens back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [B] int32, context length including the query tokens
    max_query_len: int,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,  # optional [T, Hq, D] destination (any strides)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # each query sees its last W positions only
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context: [T, Hq, D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    check_paged_inputs(query, k_cache, v_cache, block_tables)
    check_window(sliding_window)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc should be [{num_seqs + 1}], got {query_start_loc.shape}")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    quant, compute_dtype, scale_args = quantized_cache_args(query, k_cache, k_scale, v_scale)
    block_m = check_tile("block_m", block_m or default_tile(compute_dtype))
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _paged_prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        *scale_args[:2],
        scale * LOG2E,
        num_heads // num_kv_heads,
        head_dim,
        sliding_window or 0,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        *scale_args[2:],
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=check_tile("block_n", block_n or default_tile(compute_dtype)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_FP32=dot_in_fp32(compute_dtype),
        DOT_PRECISION=dot_precision(compute_dtype),
        KV_QUANT=quant,
        SLIDING=sliding_window is not None,
        num_warps=4,
    )
    return out
