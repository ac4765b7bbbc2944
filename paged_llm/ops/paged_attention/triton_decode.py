"""Triton paged decode attention: one query token per sequence, context read via block tables.

One program owns one (sequence, KV head, split) and all query heads of that KV head's GQA group,
so each K/V tile is loaded once for the whole group. The context is walked in tiles of
``BLOCK_N`` logical positions; every position finds its physical slot through the block table,
so the tile size is independent of the cache's block size (1 ... 256 all work the same way).
With ``num_splits > 1`` the context is cut into partitions processed in parallel (split-K, as
in PagedAttention v2 / flash-decoding) and a small reduce kernel merges their partial softmaxes.
With a sliding window of W (``SLIDING``) only the tiles holding the last W positions are read.

The helpers ``load_paged_tile``, ``online_softmax_step`` and ``check_paged_inputs`` are shared
with the prefill kernel.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from paged_llm.ops.tuning import FP32_ATTENTION_BLOCK, kernel_config, num_sms
from paged_llm.utils.checks import check_window

LOG2E = 1.4426950408889634  # softmax runs in base 2 (exp2 is the fast hardware instruction)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast ``tl.dot`` operands to fp32 for this cache dtype.

    Triton's interpreter stores bfloat16 as raw uint16 and its ``tl.dot`` multiplies those bit
    patterns, so under the interpreter bf16 operands are upcast first. On a GPU bf16 goes to
    the tensor cores as is.
    """
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 for fp32 caches (a debug dtype), else default.

    fp32 operands would otherwise be rounded to tf32 on the GPU (~1e-3 relative error) and
    stop matching the reference; fp16/bf16 ignore the setting.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_paged_tile(
    cache_ptr,  # [num_blocks, block_size, Hkv, D]
    table_ptr,  # this sequence's row of the block table, [max_blocks] int32
    pos,  # [BLOCK_N] logical token positions in the sequence
    pos_mask,  # [BLOCK_N] positions that exist (pos < seq_len)
    kv_head,
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D] offs_d < D
    stride_block,
    stride_slot,
    stride_head,
    stride_dim,
    BLOCK_SIZE: tl.constexpr,
    scale_ptr,  # [num_blocks, block_size, Hkv] float32 scales of a quantized cache
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    HAS_SCALE: tl.constexpr,
):
    """Gather the cached vectors of ``pos`` through the block table: [BLOCK_N, BLOCK_D]
    (dequantized to float32 when the cache is quantized)."""
    # BLOCK_SIZE is a power-of-two constexpr, so // and % compile to a shift and a mask.
    block_ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    ptrs = (
        cache_ptr
        + block_ids[:, None] * stride_block
        + (pos % BLOCK_SIZE)[:, None] * stride_slot
        + kv_head * stride_head
        + offs_d[None, :] * stride_dim
    )
    # Masked rows read 0 (never the stale/NaN content of unused slots), so p @ v stays finite.
    tile = tl.load(ptrs, mask=pos_mask[:, None] & d_mask[None, :], other=0.0)
    if HAS_SCALE:  # one scale per (slot, head), found through the same block ids
        s_ptrs = (
            scale_ptr
            + block_ids * stride_s_block
            + (pos % BLOCK_SIZE) * stride_s_slot
            + kv_head * stride_s_head
        )
        tile = tile.to(tl.float32) * tl.load(s_ptrs, mask=pos_mask, other=0.0)[:, None]
    return tile


@triton.jit
def online_softmax_step(
    q,  # [M, BLOCK_D] already in the cache dtype
    k,  # [BLOCK_N, BLOCK_D]
    v,  # [BLOCK_N, BLOCK_D]
    valid,  # [M, BLOCK_N] which (query, key) pairs may attend
    acc,  # [M, BLOCK_D] fp32 running sum of p @ v
    m_i,  # [M] fp32 running max of the base-2 logits
    l_i,  # [M] fp32 running sum of exp2(logit - m_i)
    qk_scale,  # softmax scale * log2(e)
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one K/V tile into the running (acc, m, l) of a flash-attention style softmax."""
    if DOT_FP32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N] fp32
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing valid yet keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # NUM_SPLITS == 1: [B, Hq, D] output; else [B, Hq, NUM_SPLITS, D] fp32 partial acc
    m_ptr,  # [B, Hq, NUM_SPLITS] fp32 partial max (only written when NUM_SPLITS > 1)
    l_ptr,  # [B, Hq, NUM_SPLITS] fp32 partial sum (only written when NUM_SPLITS > 1)
    k_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (only read when KV_QUANT)
    v_scale_ptr,
    qk_scale,
    group_size,  # query heads per KV head
    head_dim,
    window,  # sliding window W (read only when SLIDING)
    stride_qb,
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
    stride_ob,
    stride_oh,
    stride_os,  # split stride of the partial buffers (unused when NUM_SPLITS == 1)
    stride_od,
    stride_s_block,  # strides of both scale pools
    stride_s_slot,
    stride_s_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_G: tl.constexpr,  # query rows per program: group size padded to >= 16 for tl.dot
    BLOCK_N: tl.constexpr,  # context positions per tile
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # int8 / fp8 cache: dequantize tiles to the query dtype
    SLIDING: tl.constexpr,  # attend to the last ``window`` positions only
):
    """Attend the query heads of one KV head over one partition of one sequence's context."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group_size
    d_mask = offs_d < head_dim
    heads = kv_head * group_size + offs_g  # [BLOCK_G] query heads sharing this KV head
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if not KV_QUANT:  # compute in the cache dtype (a quantized cache comes to q's dtype instead)
        q = q.to(k_cache_ptr.dtype.element_ty)

    # The token sees positions [first, seq_len).
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    # Partition the tiles it sees evenly over the splits; trailing splits of a short
    # sequence may get none and then report l = 0, m = -inf, which the reduce step ignores.
    first_tile = first // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    table_ptr = block_tables_ptr + seq * stride_bt
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_mask = (pos < seq_len) & (pos >= first)
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
        # All query rows of a decode see the same keys: positions [first, seq_len).
        valid = tl.broadcast_to(pos_mask[None, :], (BLOCK_G, BLOCK_N))
        acc, m_i, l_i = online_softmax_step(
            q, k, v, valid, acc, m_i, l_i, qk_scale, DOT_FP32, DOT_PRECISION
        )

    out_offs = seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Keep the partial result unnormalised; the reduce kernel rescales and normalises once.
        tl.store(out_ptr + out_offs + split * stride_os, acc, mask=out_mask)
        num_heads = tl.num_programs(1) * group_size  # Hq = Hkv * group
        stat_offs = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(m_ptr + stat_offs, m_i, mask=g_mask)
        tl.store(l_ptr + stat_offs, l_i, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    part_ptr,  # [B, Hq, NUM_SPLITS, D] fp32 unnormalised partial outputs
    m_ptr,  # [B, Hq, NUM_SPLITS] fp32
    l_ptr,  # [B, Hq, NUM_SPLITS] fp32
    out_ptr,  # [B, Hq, D]
    num_heads,
    head_dim,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_ob,
    stride_oh,
    stride_od,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    BLOCK_D: tl.constexpr,
):
    """Merge the partial softmaxes of one (sequence, query head) into its final output."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < head_dim

    stat_offs = (seq * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + stat_offs, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    l_part = tl.load(l_ptr + stat_offs, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    # Empty splits have m = -inf and weigh exactly 0 (guarding the all-empty -inf - -inf case).
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [BLOCK_S]
    denom = tl.sum(w * l_part, 0)

    part = tl.load(
        part_ptr
        + seq * stride_pb
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :] * stride_pd,
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(part * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)  # [BLOCK_D]
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def default_tile(dtype: torch.dtype) -> int:
    """Default BLOCK_M / BLOCK_N: exact-fp32 dots use far more registers, so take smaller tiles.

    Spills are checked on sm_80 / sm_90 by ``experiments/kernel_compile_report.py``.
    """
    return FP32_ATTENTION_BLOCK if dtype == torch.float32 else 64


def check_tile(name: str, size: int) -> int:
    """Tiles feed ``tl.arange`` (power of two) and ``tl.dot`` (>= 16 on GPUs)."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    return size


def choose_num_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """Split long contexts only when (sequences x KV heads) alone cannot fill the GPU."""
    if device.type != "cuda" or interpreting():
        return 1
    sms = num_sms(device)
    if num_programs >= sms:
        return 1
    # Partitions of at least 512 tokens keep the reduce overhead small relative to the work.
    by_length = max(1, max_context // 512)
    return int(min(by_length, math.ceil(2 * sms / num_programs), 16))


def paged_decode_attention_triton(
    query: torch.Tensor,  # [B, Hq, D], one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the query token
    scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,  # optional [B, Hq, D] destination (any strides)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # attend to the last W positions only
) -> torch.Tensor:
    """Decode attention of each sequence's last token over its paged context: [B, Hq, D].

    ``num_splits=None`` picks a split-K factor from the GPU size; ``max_seq_len`` (a host int)
    bounds the context for that choice without a device sync. ``block_n``, ``num_warps`` and
    ``num_stages`` default to the architecture's row of ``ops/tuning.py``.
    """
    bsz, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_inputs(query, k_cache, v_cache, block_tables)
    check_window(sliding_window)
    if seq_lens.shape != (bsz,):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} should be [{bsz}]")
    if out is None:
        out = torch.empty_like(query)
    if bsz == 0:
        return out
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits is None:
        max_context = max_seq_len or block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_context = min(max_context, sliding_window)
        num_splits = choose_num_splits(bsz * num_kv_heads, max_context, query.device)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    quant, compute_dtype, scale_args = quantized_cache_args(query, k_cache, k_scale, v_scale)
    config = kernel_config("paged_decode", query.device).with_overrides(
        block_n=block_n or (FP32_ATTENTION_BLOCK if compute_dtype == torch.float32 else None),
        num_warps=num_warps,
        num_stages=num_stages,
    )

    if num_splits == 1:
        part, m, l_sum, part_strides = out, out, out, (*out.stride()[:2], 0, out.stride(2))
    else:
        part = query.new_empty((bsz, num_heads, num_splits, head_dim), dtype=torch.float32)
        m = query.new_empty((bsz, num_heads, num_splits), dtype=torch.float32)
        l_sum = torch.empty_like(m)
        part_strides = part.stride()
    _paged_decode_kernel[(bsz, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part,
        m,
        l_sum,
        *scale_args[:2],
        scale * LOG2E,
        group,
        head_dim,
        sliding_window or 0,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *part_strides,
        *scale_args[2:],
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=check_tile("block_n", config.block_n),
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        DOT_FP32=dot_in_fp32(compute_dtype),
        DOT_PRECISION=dot_precision(compute_dtype),
        KV_QUANT=quant,
        SLIDING=sliding_window is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(bsz, num_heads)](
            part,
            m,
            l_sum,
            out,
            num_heads,
            head_dim,
            *part.stride(),
            *out.stride(),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def quantized_cache_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[bool, torch.dtype, tuple]:
    """(quantized?, dtype the kernel computes in, (k_scale, v_scale, 3 scale strides)).

    A quantized cache is dequantized to the query's dtype; without one the dummy pointers are
    never read (the kernels' KV_QUANT branch is compiled out).
    """
    if k_scale is None:
        return False, k_cache.dtype, (k_cache, k_cache, 0, 0, 0)
    if k_scale.shape != k_cache.shape[:3] or v_scale.stride() != k_scale.stride():
        raise ValueError(f"scale pools must be {tuple(k_cache.shape[:3])}, alike in layout")
    return True, query.dtype, (k_scale, v_scale, *k_scale.stride())


def check_paged_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """Validate the shapes and dtypes shared by the decode and prefill wrappers."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query [*, {num_heads}, {head_dim}] does not fit caches of {num_kv_heads} KV heads "
            f"x {cache_dim} dims"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be a 2-D int32 tensor")
