"""Triton fused mixture-of-experts (vLLM's ``fused_moe``): every expert's MLP as one grouped GEMM.

Same contract as ``reference.fused_experts_reference``. Each token t is routed to k experts,
so the layer is T * k (token, slot) "pairs", pair p = t * k + j going to expert
``topk_ids[t, j]``. Rather than one GEMM per expert (E launches, most of them tiny at decode),
the pairs are sorted by expert and each expert's run is padded to a multiple of ``BLOCK_M``
(``moe_align_block_size``); one launch then covers all experts, each program owning one
``BLOCK_M`` block of sorted pairs, all of the same expert, and ``BLOCK_N`` output columns:

1. GEMM1, ``_fused_moe_kernel``: ``h[p] = gate_up[e] @ x[p // k]``, [T*k, 2I] in x's dtype
   (the A rows are gathered from x by token, so x is never replicated k times);
2. ``silu_mul``: ``a[p] = silu(h[p, :I]) * h[p, I:]``, [T*k, I] (the elementwise op's kernel);
3. GEMM2, the same kernel: ``y[p] = topk_weights[p] * (down[e] @ a[p])``, [T*k, H] float32;
4. ``y.view(T, k, H).sum(1)`` in float32, rounded to x's dtype once.

Int8 or fp8 e4m3 expert weights (``quantization="int8"`` / ``"fp8"``) are loaded as such,
converted to the activations' dtype for the dot (exact: |q| <= 127, and an e4m3 value has 3
mantissa bits and an exponent that fp16 / bf16 / fp32 all hold) and scaled per output channel
after the K loop. Int4 expert weights (``quantization="int4_rtn"``) hold two codes per byte
along K, [E, N, K/2] uint8, with a float32 scale and a uint8 zero point per output channel and
group of inputs, [E, N, G]; a K tile lies within one group (``BLOCK_K`` divides the group
size), so each tile is dequantized, ``(q - z) * s``, in float32 with the tile's one scale and
zero per column, then rounded to the activations' dtype for the dot, as the reference rounds
the dequantized weight.

Both GEMMs accumulate in float32 with ``tl.dot`` (which needs tiles of at least 16 rows, so
``BLOCK_M >= 16``). Padding rows hold the sentinel pair id T*k: they load zeros and store
nothing. The grid is sized by a static upper bound on the padded length, never by a count read
back from the GPU, so the whole layer launches without a host sync (and can be captured in a
CUDA graph); programs past the true padded length return at once.

Expert ids must lie in [0, E): they are not checked (that would cost a device sync per call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_llm.ops.elementwise import silu_mul
from paged_llm.ops.moe.reference import int4_group_tiles
from paged_llm.ops.tuning import KernelConfig, kernel_config

SCALED_DTYPES = (torch.int8, torch.float8_e4m3fn)  # expert weights that come with scales
MIN_BLOCK_M = 16  # tl.dot's smallest tile
MAX_BLOCK_M = 64  # rows per program at prefill; more pairs per expert take several blocks


def padded_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the padded sorted length: each expert that gets any pair (at most
    min(E, pairs) of them) adds fewer than ``block_m`` padding slots; rounded up to whole
    blocks. Tighter than vLLM's pairs + E * (block_m - 1) when E is large at decode."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, k] int32 / int64, values in [0, E), or -1: not here
    block_m: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert padded to whole ``block_m`` blocks: ``sorted_ids``
    [L] int32 (pair ids t * k + j; padding and the unused tail hold the sentinel T * k),
    ``block_expert`` [L / block_m] int32 (each block's expert, -1 past the end) and
    ``num_padded`` [1] int32 (the used length), with L = ``padded_length(T * k, E, block_m)``.
    Pairs with expert -1 (another rank's, under expert parallelism) are left out."""
    device = topk_ids.device
    # [P] expert of each pair; -1 becomes E, a last bucket whose run has no room
    flat = torch.where(topk_ids.reshape(-1) < 0, num_experts, topk_ids.reshape(-1)).long()
    num_pairs = flat.numel()
    length = padded_length(num_pairs, num_experts, block_m)

    # Pairs per expert; scatter_add_ rather than bincount, which reads the max back on CUDA.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E + 1]
    padded_counts = (counts + block_m - 1) // block_m * block_m  # [E + 1]
    padded_counts[num_experts] = 0
    padded_ends = padded_counts.cumsum(0)  # [E + 1] inclusive
    padded_starts = padded_ends - padded_counts  # [E + 1] where each expert's run begins
    starts = counts.cumsum(0) - counts  # [E + 1] the same without padding

    # Stable: within an expert, pairs keep token order (consecutive A rows of x).
    order = torch.argsort(flat, stable=True)  # [P] pair ids by expert
    expert_of = flat[order]  # [P]
    rank = torch.arange(num_pairs, device=device) - starts[expert_of]  # position in its run
    # a pair not on this rank goes to slot L, one past the end, dropped with it
    slot = torch.where(expert_of < num_experts, padded_starts[expert_of] + rank, length)
    sorted_ids = torch.full((length + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, slot, order.to(torch.int32))
    sorted_ids = sorted_ids[:length]

    # Block b belongs to the first expert whose padded run ends after it (empty runs skipped).
    padded_ends = padded_ends[:num_experts]
    block_starts = torch.arange(0, length, block_m, device=device)  # [L / block_m]
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_padded = padded_ends[-1:].to(torch.int32)  # [1]
    return sorted_ids, block_expert, num_padded


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows, K] any strides: x [T, H] (GEMM1) or the activation [T*k, I] (GEMM2)
    b_ptr,  # [E, N, K] any strides: gate_up [E, 2I, H] or down [E, H, I]
    c_ptr,  # [T*k, N] any strides, one row per pair
    weights_ptr,  # [T*k] routing weight of each pair (read when MUL_ROUTED_WEIGHT)
    scale_ptr,  # [E, N] per-channel scale of int8 / fp8 B (B_SCALED), [E, N, G] of int4 B
    zero_ptr,  # [E, N, G] uint8 zero points of int4 B (read when B_INT4), scale's strides
    sorted_ids_ptr,  # [L] int32 pair ids by expert, sentinel num_pairs in the padding
    block_expert_ptr,  # [L / BLOCK_M] int32 expert of each block
    num_padded_ptr,  # [1] int32 used length of sorted_ids
    N,
    K,
    num_pairs,  # T * k, the sentinel
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_se,
    stride_sn,
    stride_sg,
    A_ROW_DIV: tl.constexpr,  # A row of pair p: p // A_ROW_DIV (top_k for x, 1 for activations)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    B_SCALED: tl.constexpr,  # B is int8 / fp8: converted to A's dtype, scaled per column
    B_INT4: tl.constexpr,  # B is [E, N, K/2] packed int4, dequantized per K tile
    GROUP_SIZE: tl.constexpr,  # int4 inputs per scale (a multiple of BLOCK_K)
    BLOCK_M: tl.constexpr,  # >= 16, the padding unit of moe_align_block_size
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[pairs of one block, n-tile] = A[rows of those pairs] @ B[block's expert, n-tile].T,
    in float32, times each pair's routing weight if MUL_ROUTED_WEIGHT."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The grid covers the static bound; blocks past the used length have nothing to do.
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # int64: E * stride_be > 2**31
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # int64: pairs * row stride > 2**31
    m_mask = pair < num_pairs  # padding rows hold the sentinel
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N]
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    # Tile pointers, advanced by BLOCK_K along K each step (the increments stay small).
    a_ptrs = a_ptr + (pair // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    if B_INT4:  # byte k // 2 holds input k, in its high nibble when k is odd
        b_rows = offs_k // 2
        shifts = ((offs_k % 2) * 4)[:, None]  # [BK, 1]
        b_step = BLOCK_K // 2
    else:
        b_rows = offs_k
        b_step = BLOCK_K
    b_ptrs = b_ptr + expert * stride_be + b_rows[:, None] * stride_bk + offs_n[None, :] * stride_bn
    sz_offs = expert * stride_se + offs_n * stride_sn  # [BN] into scales (and int4 zeros)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        b_mask = k_mask[:, None] & n_mask[None, :]
        if B_INT4:
            packed = tl.load(b_ptrs, mask=b_mask, other=0)  # [BK, BN] uint8
            q = (packed.to(tl.int32) >> shifts) & 0xF
            group = k0 // GROUP_SIZE
            s = tl.load(scale_ptr + sz_offs + group * stride_sg, mask=n_mask, other=0.0)
            z = tl.load(zero_ptr + sz_offs + group * stride_sg, mask=n_mask, other=0)
            deq = (q.to(tl.float32) - z.to(tl.float32)[None, :]) * s.to(tl.float32)[None, :]
            b = deq.to(a.dtype)
        else:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)  # [BK, BN]
            if B_SCALED:  # int8 / e4m3 values are exact in fp16/bf16/fp32; the scale comes after
                b = b.to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += b_step * stride_bk
    if B_SCALED:
        s = tl.load(scale_ptr + sz_offs, mask=n_mask, other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)  # [BLOCK_M]
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 dots for fp32 activations (a debug dtype); fp16/bf16 ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Row tile from the mean pairs per expert: 16 at decode (a larger tile would be mostly
    padding), up to MAX_BLOCK_M at prefill (fewer re-reads of each expert's weights)."""
    per_expert = triton.cdiv(num_pairs, num_experts)
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(per_expert)))


def _grouped_gemm(
    a: torch.Tensor,  # [rows, K]
    b: torch.Tensor,  # [E, N, K] float, int8 / fp8 with scale, or [E, N, K/2] int4
    scale: torch.Tensor | None,  # [E, N], [E, N, G] with int4, or None
    zero: torch.Tensor | None,  # [E, N, G] uint8 with int4, else None
    out: torch.Tensor,  # [T*k, N]
    weights: torch.Tensor | None,  # [T*k] or None
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    block_m: int,
    cfg: KernelConfig,
) -> None:
    """Launch ``_fused_moe_kernel``: one program per (aligned block, ``block_n`` columns)."""
    sorted_ids, block_expert, num_padded = align
    n, k = b.shape[1], a.shape[1]
    grid = (block_expert.numel(), triton.cdiv(n, cfg.block_n))
    group, block_k = 1, cfg.block_k  # GROUP_SIZE is read only for int4
    if zero is not None:
        scale, zero = scale.contiguous(), zero.contiguous()  # one set of strides for both
        group = k // scale.shape[2]
        block_k = min(block_k, group)  # a K tile never straddles two groups
    scale_strides = (*scale.stride(), 0)[:3] if scale is not None else (0, 0, 0)
    _fused_moe_kernel[grid](
        a, b, out, weights if weights is not None else out, scale if scale is not None else out,
        zero if zero is not None else out, sorted_ids, block_expert, num_padded,
        n, k, out.shape[0], *a.stride(), *b.stride(), *out.stride(), *scale_strides,
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=weights is not None,
        B_SCALED=scale is not None and zero is None, B_INT4=zero is not None, GROUP_SIZE=group,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(a.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


def check_moe_args(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    gate_up_zero: torch.Tensor | None = None,
    down_zero: torch.Tensor | None = None,
) -> None:
    """Shapes, dtypes and devices of fused_experts' arguments (no device values are read)."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"fused_experts takes x [T, H], gate_up [E, 2I, H] and down [E, H, I], got "
            f"{tuple(x.shape)}, {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    tokens, hidden = x.shape
    experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    packed = gate_up_zero is not None, down_zero is not None  # int4: two inputs per byte
    gate_up_k, down_k = (w.shape[2] * (2 if p else 1) for w, p in zip((gate_up, down), packed))
    if two_i % 2 or gate_up_k != hidden or (*down.shape[:2], down_k) != (experts, hidden, inter):
        raise ValueError(
            f"fused_experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down "
            f"{tuple(down.shape)} disagree (want [T, H], [E, 2I, H], [E, H, I])"
        )
    if experts == 0:
        raise ValueError("fused_experts: no experts")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_experts: topk_weights {tuple(topk_weights.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [T, k] with T = {tokens}"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fused_experts: x must be float32/float16/bfloat16, got {x.dtype}")
    for name, w, scale, zero, rows, k in (
        ("gate_up", gate_up, gate_up_scale, gate_up_zero, two_i, hidden),
        ("down", down, down_scale, down_zero, hidden, inter),
    ):
        if scale is None and (w.dtype != x.dtype or zero is not None):
            raise ValueError(f"fused_experts: {name} ({w.dtype}) must have x's dtype {x.dtype}")
        if zero is not None:
            _check_int4(name, w, scale, zero, rows, k)
        elif scale is not None and (w.dtype not in SCALED_DTYPES or scale.shape != (experts, rows)):
            raise ValueError(
                f"fused_experts: a scaled {name} must be int8 or float8_e4m3fn with scales "
                f"[{experts}, {rows}], got {w.dtype} and {tuple(scale.shape)}"
            )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_experts: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"fused_experts: topk_weights must be floating, got {topk_weights.dtype}")
    scales = [t for t in (gate_up_scale, down_scale, gate_up_zero, down_zero) if t is not None]
    devices = {t.device for t in (x, gate_up, down, topk_weights, topk_ids, *scales)}
    if len(devices) != 1:
        raise ValueError(f"fused_experts: arguments on several devices {sorted(map(str, devices))}")


def _check_int4(
    name: str, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, rows: int, k: int
) -> None:
    """An int4 projection: [E, rows, k/2] uint8 codes, [E, rows, G] scales and zeros, and a
    group size (k / G) that K tiles can divide: a power of two of at least 16."""
    experts = w.shape[0]
    groups = scale.shape[2] if scale.dim() == 3 else 0
    group = k // groups if groups and k % groups == 0 else 0
    if (
        w.dtype != torch.uint8
        or zero.dtype != torch.uint8
        or scale.shape != zero.shape
        or scale.shape[:2] != (experts, rows)
        or not int4_group_tiles(group)
    ):
        raise ValueError(
            f"fused_experts: an int4 {name} must be [{experts}, {rows}, {k // 2}] uint8 with "
            f"scales and uint8 zeros [{experts}, {rows}, G], {k} / G a power of two >= 16; got "
            f"{w.dtype} {tuple(w.shape)}, scales {tuple(scale.shape)}, zeros {zero.dtype} "
            f"{tuple(zero.shape)}"
        )


def fused_experts_triton(
    x: torch.Tensor,  # [T, H] float32/float16/bfloat16, any strides
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I); any strides
    down: torch.Tensor,  # [E, H, I], any strides
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32/int64 in [0, E) (not checked: a device sync)
    gate_up_scale: torch.Tensor | None = None,  # [E, 2I] with an int8 / fp8 gate_up
    down_scale: torch.Tensor | None = None,  # [E, H] with an int8 / fp8 down
    gate_up_zero: torch.Tensor | None = None,  # [E, 2I, G] with an int4 gate_up (scale too)
    down_zero: torch.Tensor | None = None,  # [E, H, G] with an int4 down
    *,
    block_m: int | None = None,  # tile / launch overrides for sweeps and tests (powers of two)
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [T, H] in x's dtype
    """sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j]."""
    check_moe_args(x, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale,
                   gate_up_zero, down_zero)  # fmt: skip
    for name, block in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if block is not None and (block < 16 or block & (block - 1)):
            raise ValueError(f"fused_experts: {name} must be a power of two >= 16, got {block}")
    tokens, hidden = x.shape
    experts, two_i, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0 or hidden == 0 or two_i == 0:
        return torch.zeros(tokens, hidden, dtype=x.dtype, device=x.device)

    cfg = kernel_config("fused_moe", x.device).with_overrides(
        block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages
    )
    block_m = block_m or choose_block_m(num_pairs, experts)
    align = moe_align_block_size(topk_ids, block_m, experts)

    # GEMM1: x's rows gathered per pair (row t for pairs t*k .. t*k + k-1), rounded to x's
    # dtype as F.linear rounds in the reference.
    gate_up_out = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)  # [T*k, 2I]
    _grouped_gemm(x, gate_up, gate_up_scale, gate_up_zero, gate_up_out, None, align, top_k,
                  block_m, cfg)  # fmt: skip
    act = silu_mul(gate_up_out[:, : two_i // 2], gate_up_out[:, two_i // 2 :])  # [T*k, I]

    # GEMM2 in float32 with the routing weight applied, so the k-sum rounds only once. Zeros:
    # rows of pairs routed to another rank's experts are never written.
    weights = topk_weights.reshape(-1)  # [T*k] pair order t*k + j (a copy if not contiguous)
    down_out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [T*k, H]
    _grouped_gemm(act, down, down_scale, down_zero, down_out, weights, align, 1, block_m, cfg)
    return down_out.view(tokens, top_k, hidden).sum(1).to(x.dtype)
