"""Triton paged prefill attention over variable-length query batches, FlashAttention style.

Sequence b contributes ``Lq = query_start_loc[b + 1] - query_start_loc[b]`` query tokens that
are the LAST Lq positions of its ``seq_lens[b]`` context; the earlier positions (a cached
prefix, or earlier chunks of a chunked prefill) are already in the paged cache, as are this
step's own K/V (the backend stores them first). So pure prefill (Lq == seq_len), prefill with a
prefix and single-token queries (decodes) are all the same causal kernel.

Design (the ideas of vLLM's unified Triton attention):

* **Launch from shapes only.** The grid is ``(T // BLOCK_Q + B, Hkv)`` with T = query.shape[0]
  and B = seq_lens.shape[0]; no host value read from the batch (no max query length), so one
  captured CUDA graph replays any batch of the same padded shape, mixed prefill + decode steps
  included. Sequence b owns the programs from ``query_start_loc[b] // BLOCK_Q + b`` on, which
  is at least its ceil(Lq / BLOCK_Q) query blocks; a program finds its sequence by a binary
  search over ``query_start_loc`` and returns at once when its block lies past that
  sequence's queries (so padding sequences with Lq = 0, and the spare programs, cost a few
  loads each).
* **GQA packing.** A program covers BLOCK_Q query tokens x the G = Hq / Hkv query heads of its
  KV head as one tile of BLOCK_M = BLOCK_Q * G rows (row r is token r // G, head r % G; BLOCK_M
  is a power of two and rows past BLOCK_Q * G are masked when G is not), so every K/V tile is
  read once per group rather than once per query head.
* **Causal split.** Tiles that end at or before the block's first query position need no
  mask at all (and load without bounds checks); only the ~BLOCK_Q / BLOCK_N + 1 tiles around
  the diagonal apply the causal mask. With a sliding window (``SLIDING``) a query at position
  p sees p - W + 1 ... p: tiles before the window of the block's first query are skipped and
  the masked loop covers the rest.

The tiles come from ``kernel_config("paged_prefill", device)`` (ops/tuning.py), each
overridable per call. Rows of ``query`` past ``query_start_loc[-1]`` (padding tokens) belong
to no sequence and are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_llm.ops.paged_attention.triton_decode import (
    LOG2E,
    check_paged_inputs,
    check_tile,
    dot_in_fp32,
    dot_precision,
    load_paged_tile,
    online_softmax_step,
    quantized_cache_args,
)
from paged_llm.ops.tuning import FP32_ATTENTION_BLOCK, kernel_config
from paged_llm.utils.checks import check_window


@triton.jit
def _find_sequence(
    query_start_loc_ptr,  # [B + 1] int32
    program,  # this program's index along grid axis 0
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """The last sequence b whose first program ``query_start_loc[b] // BLOCK_Q + b`` is at or
    before ``program``. The ``+ b`` makes those starts strictly increasing, so sequences with
    no queries (padding) take part in the search without ties."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


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
    num_seqs,  # B
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
    GROUP: tl.constexpr,  # G: query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program (BLOCK_M // GROUP)
    BLOCK_M: tl.constexpr,  # rows per program, BLOCK_Q * GROUP padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # context positions per tile (>= 16 for tl.dot)
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two (>= 16)
    EVEN_D: tl.constexpr,  # head_dim == BLOCK_D: no column mask needed
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # int8 / fp8 cache: dequantize tiles to the query dtype
    SLIDING: tl.constexpr,  # attend to the last ``window`` positions of each query only
):
    """Causal attention of BLOCK_Q queries x GROUP heads of one sequence over its context."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, program, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = program - (q_start // BLOCK_Q + seq)  # this program's block within the sequence
    # Spare programs (past this sequence's queries, or a padding sequence's) have no work.
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP  # each row's query index within the sequence
    heads = kv_head * GROUP + offs_m % GROUP  # each row's query head
    m_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    if EVEN_D:  # a constant-true mask folds away in the compiler
        d_mask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        d_mask = offs_d < head_dim
    q_pos = seq_len - q_len + q_idx  # each row's absolute position in the context
    tokens = (q_start + q_idx).to(tl.int64)  # rows of the flat [T, ...] batch
    q_rows = tokens * stride_qt + heads * stride_qh  # [BLOCK_M] offsets of each row's vector
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if not KV_QUANT:  # compute in the cache dtype (a quantized cache comes to q's dtype instead)
        q = q.to(k_cache_ptr.dtype.element_ty)

    first_pos = seq_len - q_len + q_block * BLOCK_Q  # the block's first query position
    # Causality: nothing after the block's last query position is ever needed.
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    # Tiles ending at or before first_pos are visible to every row: no mask there.
    diag_start = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_lo = 0  # first position any row sees
    if SLIDING:
        # Nothing before the window of the block's first query; the masked loop does the rest.
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        diag_start = (kv_lo // BLOCK_N) * BLOCK_N
    else:
        all_pos = tl.full([BLOCK_N], 1, tl.int1)  # constant masks: unmasked loads and softmax
        all_valid = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
        for start in range(0, diag_start, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k = load_paged_tile(
                k_cache_ptr, table_ptr, pos, all_pos, kv_head, offs_d, d_mask,
                stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim, BLOCK_SIZE,
                k_scale_ptr, stride_s_block, stride_s_slot, stride_s_head, KV_QUANT,
            ).to(q.dtype)  # fmt: skip
            v = load_paged_tile(
                v_cache_ptr, table_ptr, pos, all_pos, kv_head, offs_d, d_mask,
                stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim, BLOCK_SIZE,
                v_scale_ptr, stride_s_block, stride_s_slot, stride_s_head, KV_QUANT,
            ).to(q.dtype)  # fmt: skip
            acc, m_i, l_i = online_softmax_step(
                q, k, v, all_valid, acc, m_i, l_i, qk_scale, DOT_FP32, DOT_PRECISION
            )

    # The diagonal tiles (and, with a window, every tile): causal and bounds masks.
    for start in range(diag_start, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = (pos < kv_end) & (pos >= kv_lo)  # never read blocks before the window
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
    out_rows = tokens * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + out_rows[:, None] + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def query_block(block_m: int, group: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q query tokens) of one program for ``block_m`` requested rows and
    G = ``group`` query heads per KV head: BLOCK_Q = BLOCK_M // G tokens x G heads, with BLOCK_M
    grown to the next power of two of G when one token's heads alone exceed it."""
    rows = max(check_tile("block_m", block_m), triton.next_power_of_2(group))
    return rows, rows // group


def prefill_grid(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int) -> tuple:
    """The launch grid: a function of shapes only (see the module docstring)."""
    return (num_tokens // block_q + num_seqs, num_kv_heads)


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [T, Hq, D], sequences' query tokens back to back (then padding)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [B] int32, context length including the query tokens
    scale: float,
    *,
    block_m: int | None = None,  # rows (query tokens x heads of a group) per program
    block_n: int | None = None,  # context positions per tile
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,  # optional [T, Hq, D] destination (any strides)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: quantized cache
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # each query sees its last W positions only
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context: [T, Hq, D].

    The launch depends on the tensors' shapes only, so it can be captured in a CUDA graph and
    replayed with other contents. Padding is allowed: sequences with no queries and no
    context (``query_start_loc`` repeating its last value, ``seq_lens`` 0) and rows of
    ``query`` past ``query_start_loc[-1]``; those rows of ``out`` are left as they were.
    ``block_m``, ``block_n``, ``num_warps`` and ``num_stages`` default to the architecture's
    ``paged_prefill`` row of ``ops/tuning.py``.
    """
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
    config = kernel_config("paged_prefill", query.device)
    if compute_dtype == torch.float32:  # exact-fp32 dots need far more registers per tile
        fp32_tile = FP32_ATTENTION_BLOCK
        config = config.with_overrides(
            block_m=min(config.block_m, fp32_tile), block_n=min(config.block_n, fp32_tile)
        )
    config = config.with_overrides(
        block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages
    )
    group = num_heads // num_kv_heads
    rows, block_q = query_block(config.block_m, group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_prefill_kernel[prefill_grid(num_tokens, num_seqs, num_kv_heads, block_q)](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        *scale_args[:2],
        scale * LOG2E,
        num_seqs,
        head_dim,
        sliding_window or 0,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        *scale_args[2:],
        GROUP=group,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=rows,
        BLOCK_N=check_tile("block_n", config.block_n),
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        DOT_FP32=dot_in_fp32(compute_dtype),
        DOT_PRECISION=dot_precision(compute_dtype),
        KV_QUANT=quant,
        SLIDING=sliding_window is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
