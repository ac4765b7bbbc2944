"""Triton dequantize-and-multiply for decode-shaped inputs (a few rows x a quantized weight).

At decode time a linear layer multiplies a handful of activation rows by a large weight, so the
cost is reading the weight: reading it as int8 (or int4) instead of fp16 halves (or quarters)
the bytes. Each program owns ``BLOCK_N`` output columns of one tile of ``BLOCK_M`` rows
(padded to a power of two, at most 64) and walks K in tiles, expanding each weight tile to
the activation dtype in registers right before ``tl.dot``; the full-precision weight never
exists in memory.

``tl.dot`` needs at least 16 rows per tile, so a batch-1 decode would spend 15/16 of each tile's
work on padding. Up to ``gemv_rows`` rows (a per-architecture setting in ``ops/tuning.py``) the
kernels instead multiply and sum over K on the CUDA cores (a GEMV), with the row tile padded
only to a power of two. At decode sizes unpacking nibbles, not reading bytes, is what limits
an int4 matmul, so both int4 kernels load each packed int32 once and avoid int->float
conversions per weight; the GEMV is its own kernel, ``_int4_gemv_kernel``, whose inner
product takes three instructions per weight (``experiments/kernel_compile_report`` counts
the compiled loops: 5.8 instructions per weight in all on sm_90).

The 8-bit kernel also takes FP8 (e4m3) weights: at decode shapes it is a weight-only FP8 path
that skips quantizing the activations, which ``torch._scaled_mm`` needs.

Same contract as ``reference.int8_matmul_reference`` / ``int4_matmul_reference``. The int4
kernel assumes the plain group order ``g_idx[k] = k // group_size`` (no act-order), which the
caller checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_llm.ops.paged_attention.triton_decode import interpreting
from paged_llm.ops.quant_matmul import DECODE_MAX_ROWS
from paged_llm.ops.tuning import KernelConfig, kernel_config, num_sms

MAX_ROWS = DECODE_MAX_ROWS  # more rows (prefill) are cheaper as dequantize + one matmul
MAX_BLOCK_M = 64  # rows per program; larger batches take several row tiles


def _block_m(rows: int, gemv: bool) -> int:
    """Row tile: rows padded to a power of two, >= 16 for tl.dot (its minimum), <= MAX_BLOCK_M."""
    return min(MAX_BLOCK_M, max(1 if gemv else 16, triton.next_power_of_2(rows)))


# Per-thread product elements of one GEMV K tile ([BLOCK_M, BLOCK_K, BLOCK_N] over the program's
# threads); more would spill registers, so the K tile shrinks as the row tile grows.
GEMV_ELEMENTS_PER_THREAD = 64


def _gemv_block_k(block_k: int, block_m: int, block_n: int, num_warps: int, k_pack: int = 1) -> int:
    """The K tile of a GEMV launch: ``block_k`` capped by the register budget (a power of 2).
    ``k_pack`` K rows share one tile element (8 for int4, whose tiles hold packed int32s)."""
    budget = GEMV_ELEMENTS_PER_THREAD * 32 * num_warps * k_pack // (block_m * block_n)
    return max(16, min(block_k, 1 << max(0, budget.bit_length() - 1)))


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x[BLOCK_M, BLOCK_K] @ w[BLOCK_K, BLOCK_N] in fp32 (w exact in x's dtype): on tensor
    cores, or (few rows) as a broadcast multiply summed over K on the CUDA cores."""
    if USE_DOT:
        return tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    return tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)


def _dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 dots for fp32 activations (a debug dtype); fp16/bf16 ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _w8_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] int8 or float8_e4m3fn
    scale_ptr,  # [N] per-output-channel scales
    out_ptr,  # [M, N]; with SPLIT_K > 1: [SPLIT_K, M, N] fp32 partial sums
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_os,  # split stride of the partial sums (unused when SPLIT_K == 1)
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[m-tile, n-tile] (+)= (x[m-tile, k-split] @ w[n-tile, k-split].T) * scale[n-tile]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]; int8 |w| <= 127 and e4m3 are exact in fp16/bf16/fp32
        acc += _tile_product(x, w, USE_DOT, DOT_PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    _store_tile(acc * scale[None, :], out_ptr + pid_k * stride_os, offs_m, offs_n, m_mask, n_mask,
                stride_om, stride_on)  # fmt: skip


@triton.jit
def _store_tile(acc, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om, stride_on):
    """Store a [BLOCK_M, BLOCK_N] tile in the output's dtype (fp32 for partial sums)."""
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _group_zero_and_scale(qzeros_ptr, scales_ptr, g, offs_n, n_mask, zero_offset,
                          stride_zg, stride_zn, stride_sg, stride_sn):  # fmt: skip
    """Group ``g``'s zero points (int32; column n is nibble n % 8 of its qzeros int32) and
    scales for the columns ``offs_n``: two [BLOCK_N] vectors."""
    zp = tl.load(qzeros_ptr + g * stride_zg + (offs_n // 8) * stride_zn, mask=n_mask, other=0)
    s = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
    return ((zp >> ((offs_n % 8) * 4)) & 0xF) + zero_offset, s


@triton.jit
def _int4_minus_zero(q, z, dtype: tl.constexpr):
    """q - z (q, z in [0, 16] as int32) in ``dtype``, exactly, without an int->float conversion
    per weight: q is written under the exponent bits of a power of two P that dtype holds with
    unit spacing (P = 1024 in fp16, 128 in bf16, 2**23 in fp32), so the bits read as P + q.
    Only z + P is converted (one value per column; through fp32, which the interpreter's
    int->bf16 conversion needs)."""
    zp = z.to(tl.float32)
    if dtype == tl.float16:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (zp + 1024).to(dtype)
    elif dtype == tl.bfloat16:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (zp + 128).to(dtype)
    else:
        return (q | FLOAT_2_23).to(tl.float32, bitcast=True) - (zp + 8388608.0)


@triton.jit
def _int4_matmul_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K/8, N] int32, GPTQ layout (eight input rows per int32)
    qzeros_ptr,  # [G, N/8] int32 (eight output columns per int32)
    scales_ptr,  # [G, N]
    out_ptr,  # [M, N]; with SPLIT_K > 1: [SPLIT_K, M, N] fp32 partial sums
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    zero_offset,  # added to the stored zeros (GPTQ stores zero - 1)
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_zg,
    stride_zn,
    stride_sg,
    stride_sn,
    stride_os,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE, so one K tile lies in one group
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[m-tile, n-tile] (+)= x[m-tile, k-split] @ ((q - z) * s)[k-split, n-tile] on tensor
    cores (``_int4_gemv_kernel`` takes the few-row launches)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_p = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    # K is a multiple of GROUP_SIZE, hence of BLOCK_K
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        # Each int32 is loaded once and spread over its eight rows: row 8 p + j of the tile
        # takes nibble j of packed row p.
        packed = tl.load(
            qweight_ptr + (k0 // 8 + offs_p)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
            mask=n_mask[None, :],
            other=0,
        )  # [BLOCK_K / 8, BLOCK_N]
        q = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        z, s = _group_zero_and_scale(
            qzeros_ptr,
            scales_ptr,
            k0 // GROUP_SIZE,
            offs_n,
            n_mask,
            zero_offset,
            stride_zg,
            stride_zn,
            stride_sg,
            stride_sn,
        )
        # The tile lies in one group, so its scale factors out of the dot: multiply the small
        # [BLOCK_M, BLOCK_N] result instead of every weight. q - z in [-16, 15] is exact in
        # every float dtype.
        w = _int4_minus_zero(q, z[None, :], x.dtype)  # [BLOCK_K, BLOCK_N] in x's dtype
        acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s.to(tl.float32)[None, :]
    _store_tile(acc, out_ptr + pid_k * stride_os, offs_m, offs_n, m_mask, n_mask,
                stride_om, stride_on)  # fmt: skip


# float32 bits of 2**23: with these bits set, bits 0-22 read as 2**23 + their value
FLOAT_2_23 = tl.constexpr(0x4B000000)


@triton.jit
def _under_2_23(bits):
    """``bits`` (< 2**23) with the exponent of 2**23 set (see ``_nibble``)."""
    return bits | FLOAT_2_23


@triton.jit
def _nibble(word, SHIFT: tl.constexpr):
    """The 4-bit field at ``SHIFT`` of ``word`` (made by ``_under_2_23``) times 2**SHIFT, as
    float32, exactly, in two instructions: one AND keeps the exponent and the field, and the
    bits then read as 2**23 + value. An int->float conversion would run at a quarter of the
    FMA rate on NVIDIA GPUs, and a shift per nibble would add a third instruction."""
    return (word & (FLOAT_2_23 | (0xF << SHIFT))).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # [M, K], M small (decode)
    qweight_ptr,  # [K/8, N] int32, GPTQ layout (eight input rows per int32)
    qzeros_ptr,  # [G, N/8] int32 (eight output columns per int32)
    scales_ptr,  # [G, N]
    out_ptr,  # [M, N]; with SPLIT_K > 1: [SPLIT_K, M, N] fp32 partial sums
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    zero_offset,  # added to the stored zeros (GPTQ stores zero - 1)
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_zg,
    stride_zn,
    stride_sg,
    stride_sn,
    stride_os,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE, so one K tile lies in one group
    SPLIT_K: tl.constexpr,
):
    """out[m-tile, n-tile] (+)= x[m-tile, k-split] @ ((q - z) * s)[k-split, n-tile], for few
    rows: multiply-and-add on the CUDA cores, reduced over K once at the end.

    Decode-sized int4 matmuls are bound by the instructions that unpack the weights, not by
    reading them, so the inner product spends three per weight: each packed int32 is loaded once
    (a [BLOCK_K / 8, BLOCK_N] tile), nibble j is masked in place and read as a float by
    ``_nibble`` (q * 16**j, exact), then multiplied by x[k] / 16**j (exact: a power of two).
    The zero point factors out of the sum, sum_k x_k (q_k - z) = sum_k x_k q_k -
    z sum_k x_k, and the scale out of the tile. Partial sums stay per [row, packed row,
    column] until the end, so no cross-thread reduction runs inside the loop."""
    KP: tl.constexpr = BLOCK_K // 8  # packed rows per K tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, KP)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, KP, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    # K is a multiple of GROUP_SIZE, hence of BLOCK_K
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        rows_p = k0 // 8 + offs_p  # [KP]
        # Loaded as a 3-D tile so that its load layout (several contiguous columns per
        # thread) is the layout the whole loop computes in: each thread then reuses each
        # x value it loads across those columns.
        packed = tl.load(
            qweight_ptr + rows_p[None, :, None] * stride_qk + offs_n[None, None, :] * stride_qn,
            mask=n_mask[None, None, :],
            other=0,
        )  # [1, KP, BLOCK_N]
        # nibbles 0-4 stay in place, 5-7 move to bits 0-11 (2**23 cannot hold them in place)
        low = _under_2_23(packed & 0xFFFFF)
        high = _under_2_23((packed >> 20) & 0xFFF)
        xq = tl.zeros([BLOCK_M, KP, BLOCK_N], dtype=tl.float32)  # sum_j x q over the tile
        xs = tl.zeros([BLOCK_M, KP], dtype=tl.float32)  # sum_j x
        for j in tl.static_range(8):
            # [BLOCK_M, KP]: x[k] for k = 8 p + j. Loaded 2-D and broadcast over the columns
            # afterwards, so each thread loads each of its x values once.
            x2 = tl.load(
                x_rows + (rows_p * 8 + j)[None, :] * stride_xk, mask=m_mask[:, None], other=0.0
            ).to(tl.float32)
            xs += x2
            x = x2[:, :, None]
            if j < 5:
                xq += (x * (1.0 / (1 << (4 * j)))) * _nibble(low, 4 * j)  # q * 16**j
            else:
                xq += (x * (1.0 / (1 << (4 * (j - 5))))) * _nibble(high, 4 * (j - 5))
        z, s = _group_zero_and_scale(
            qzeros_ptr,
            scales_ptr,
            k0 // GROUP_SIZE,
            offs_n,
            n_mask,
            zero_offset,
            stride_zg,
            stride_zn,
            stride_sg,
            stride_sn,
        )
        z = z.to(tl.float32)
        acc += (xq - xs[:, :, None] * z[None, None, :]) * s.to(tl.float32)[None, None, :]
    _store_tile(tl.sum(acc, axis=1), out_ptr + pid_k * stride_os, offs_m, offs_n, m_mask, n_mask,
                stride_om, stride_on)  # fmt: skip


def _check_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(
            f"decode kernels take [M <= {MAX_ROWS}, K] inputs, got {tuple(x.shape)}; "
            "use the reference (dequantize + matmul) path for larger batches"
        )


def choose_split_k(programs: int, k_tiles: int, device: torch.device) -> int:
    """Split K when (row tiles x column tiles) alone cannot keep every SM reading weights:
    aim at ~4 programs per SM (the bytes in flight a GEMV needs), at most 16 splits."""
    if device.type != "cuda" or interpreting():
        return 1
    sms = num_sms(device)
    if programs >= 4 * sms:
        return 1
    return max(1, min(k_tiles, 16, math.ceil(4 * sms / programs)))


@dataclass(frozen=True)
class _Launch:
    """Grid, tiles, split and output buffer of one quantized matmul call."""

    grid: tuple[int, int, int]
    block_m: int
    block_k: int
    use_dot: bool
    split_k: int
    k_per_split: int
    target: torch.Tensor  # out, or the [split_k, M, N] fp32 partial sums
    split_stride: int

    def meta(self, cfg: KernelConfig, dtype: torch.dtype) -> dict:
        """The launch's compile-time arguments and launch options."""
        return dict(
            BLOCK_M=self.block_m, BLOCK_N=cfg.block_n, BLOCK_K=self.block_k,
            SPLIT_K=self.split_k, USE_DOT=self.use_dot, DOT_PRECISION=_dot_precision(dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


def launch_config(kernel: str, x: torch.Tensor, overrides: dict[str, int | None]) -> KernelConfig:
    """The tuned row of ``kernel`` (``int8`` or ``int4``) for ``x``'s rows and device: its
    ``_gemv`` row up to the ``_matmul`` row's ``gemv_rows``, the ``_matmul`` (tl.dot) row
    beyond; ``overrides`` apply to whichever is chosen (gemv_rows first)."""
    dot = kernel_config(f"{kernel}_matmul", x.device).with_overrides(**overrides)
    if x.shape[0] > dot.gemv_rows:
        return dot
    return kernel_config(f"{kernel}_gemv", x.device).with_overrides(
        **{**overrides, "gemv_rows": dot.gemv_rows}
    )


def _plan_launch(
    x: torch.Tensor, n: int, k: int, cfg: KernelConfig, k_tile: int, k_pack: int = 1
) -> _Launch:
    rows = x.shape[0]
    gemv = rows <= cfg.gemv_rows
    block_m = _block_m(rows, gemv)
    if gemv:
        k_tile = _gemv_block_k(k_tile, block_m, cfg.block_n, cfg.num_warps, k_pack)
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(rows, block_m)
    k_tiles = triton.cdiv(k, k_tile)
    split_k = cfg.split_k or choose_split_k(tiles, k_tiles, x.device)
    split_k = min(split_k, k_tiles)
    k_per_split = triton.cdiv(k_tiles, split_k) * k_tile
    split_k = triton.cdiv(k, k_per_split)  # no empty trailing splits
    if split_k == 1:
        target = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    else:
        target = torch.empty(split_k, rows, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(rows, block_m), split_k)
    return _Launch(grid, block_m, k_tile, not gemv, split_k, k_per_split, target,
                   target.stride(0))  # fmt: skip


def _finish(launch: _Launch, dtype: torch.dtype) -> torch.Tensor:
    """The [M, N] result: the output itself, or the sum of the partial sums in ``dtype``."""
    if launch.split_k == 1:
        return launch.target
    return launch.target.sum(0).to(dtype)


def _w8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kernel: str,
               overrides: dict[str, int | None]) -> torch.Tensor:  # fmt: skip
    """Launch the per-channel-scaled 8-bit weight kernel (int8 or e4m3 weights)."""
    _check_rows(x)
    n, k = weight.shape
    if x.shape[1] != k or scale.shape != (n,):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and scale {tuple(scale.shape)} "
            "disagree"
        )
    if x.shape[0] == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    cfg = launch_config(kernel, x, overrides)
    launch = _plan_launch(x, n, k, cfg, cfg.block_k)
    _w8_matmul_kernel[launch.grid](
        x, weight, scale, launch.target, x.shape[0], n, k, launch.k_per_split,
        *x.stride(), *weight.stride(), launch.split_stride, *launch.target.stride()[-2:],
        **launch.meta(cfg, x.dtype),
    )  # fmt: skip
    return _finish(launch, x.dtype)


def int8_matmul_triton(
    x: torch.Tensor,  # [M <= MAX_ROWS, K]
    weight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N]
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    gemv_rows: int | None = None,
) -> torch.Tensor:  # [M, N]
    """``x @ (weight * scale[:, None]).T`` without materialising the dequantized weight.

    Launch parameters default to the architecture's row of ``ops/tuning.py``; ``split_k`` 0 or
    None picks the K split from the GPU size."""
    if weight.dtype != torch.int8:
        raise ValueError(f"int8_matmul_triton needs an int8 weight, got {weight.dtype}")
    overrides = dict(block_n=block_n, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages, split_k=split_k, gemv_rows=gemv_rows)  # fmt: skip
    return _w8_matmul(x, weight, scale, "int8", overrides)


def fp8_matmul_triton(
    x: torch.Tensor,  # [M <= MAX_ROWS, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N]
    **overrides: int | None,
) -> torch.Tensor:  # [M, N]
    """Weight-only FP8: ``x @ (weight * scale[:, None]).T`` with x kept in its own dtype.

    Same kernel and tuned row as int8 (both read one byte per weight)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_matmul_triton needs a float8_e4m3fn weight, got {weight.dtype}")
    return _w8_matmul(x, weight, scale, "int8", overrides)


def int4_matmul_triton(
    x: torch.Tensor,  # [M <= MAX_ROWS, K]
    qweight: torch.Tensor,  # [K/8, N] int32
    qzeros: torch.Tensor,  # [K/group_size, N/8] int32
    scales: torch.Tensor,  # [K/group_size, N]
    group_size: int,
    zero_offset: int,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    gemv_rows: int | None = None,
) -> torch.Tensor:  # [M, N]
    """``x @ dequant(W).T`` for a GPTQ-layout int4 weight with ``g_idx[k] = k // group_size``.

    Launch parameters default to the architecture's row of ``ops/tuning.py``; the K tile is
    capped at the group size (one tile lies in one group)."""
    _check_rows(x)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[1] != k or k % group_size or scales.shape != (k // group_size, n):
        raise ValueError(
            f"x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} "
            f"and group_size {group_size} disagree"
        )
    cfg = launch_config("int4", x, dict(
        block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
        split_k=split_k, gemv_rows=gemv_rows,
    ))  # fmt: skip
    tile_k = min(group_size, cfg.block_k)
    if group_size % tile_k or tile_k % 16:
        raise ValueError(
            f"group_size {group_size} and block_k {cfg.block_k} need a common K tile that is "
            "a multiple of 16 dividing the group"
        )
    if x.shape[0] == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    # One tile element holds eight K rows (a packed int32), but the GEMV keeps two fp32 tiles
    # live (the tile's sum and the accumulator): budget the K tile for four rows per element.
    launch = _plan_launch(x, n, k, cfg, tile_k, k_pack=4)
    args = (
        x, qweight, qzeros, scales, launch.target, x.shape[0], n, k, launch.k_per_split,
        zero_offset, *x.stride(), *qweight.stride(), *qzeros.stride(), *scales.stride(),
        launch.split_stride, *launch.target.stride()[-2:],
    )  # fmt: skip
    meta = launch.meta(cfg, x.dtype)
    del meta["USE_DOT"]  # two kernels, one per path
    if launch.use_dot:
        _int4_matmul_kernel[launch.grid](*args, GROUP_SIZE=group_size, **meta)
    else:
        del meta["DOT_PRECISION"]
        _int4_gemv_kernel[launch.grid](*args, GROUP_SIZE=group_size, **meta)
    return _finish(launch, x.dtype)
