"""Fused Triton kernels for the per-token elementwise ops of a decoder layer.

In eager torch, RMSNorm is five kernels (cast, square, mean, rsqrt-multiply, cast-scale), the
rotary embedding about eight per tensor and the SwiGLU gate two; at decode every one is a
launch over a few kilobytes, so per layer they cost more than the bytes they move (H200 run 2's
profile, docs/gpu.md). Each kernel here reads its inputs once and writes its output once, and
rounds at the same points as the torch reference (``reference.py``), so results agree to the
last float32 ulp before the final cast.

Shapes are written beside each argument; every kernel takes any row stride, so views of larger
tensors (q/k heads inside a projection output) work without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_llm.ops.elementwise.reference import (
    rms_norm_reference,
    rotary_reference,
    silu_mul_reference,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    H,
    eps,
    stride_x,
    stride_o,
    BLOCK_H: tl.constexpr,
):
    """One row: y = (x * rsqrt(mean(x^2) + eps)) cast to x's dtype, then times the weight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [T, H] (contiguous last dim): [T, H] in ``x``'s dtype."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm takes [T, H] rows and an [H] weight, got {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.shape[1], eps, x.stride(0), out.stride(0),
            BLOCK_H=triton.next_power_of_2(x.shape[1]),
        )  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, NH, D] (any token / head strides, contiguous D)
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D]
    out_ptr,  # [T, NH, D] contiguous
    NH,
    HALF,  # D / 2
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    BLOCK_NH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """All heads of one token: out = x * cos + rotate_half(x) * sin, each product rounded to the
    dtype before the sum, as eager torch rounds."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_NH)[:, None]
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NH) & (offs < HALF)
    dt = out_ptr.dtype.element_ty
    base = x_ptr + t * stride_xt + heads * stride_xh
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    out1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    out2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    obase = out_ptr + t * stride_ot + heads * stride_oh
    tl.store(obase + offs, out1.to(dt), mask=mask)
    tl.store(obase + HALF + offs, out2.to(dt), mask=mask)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, NH, D] by per-token ``cos`` / ``sin`` [T, D]: [T, NH, D]."""
    t, nh, d = x.shape
    if d % 2 or x.stride(-1) != 1 or cos.shape != (t, d) or sin.stride() != cos.stride():
        raise ValueError(f"rotary takes x [T, NH, D] (even D) and cos/sin [T, D], got {x.shape}")
    out = torch.empty((t, nh, d), dtype=x.dtype, device=x.device)
    if t:
        _rotary_kernel[(t,)](
            x, cos, sin, out, nh, d // 2, x.stride(0), x.stride(1), cos.stride(0),
            out.stride(0), out.stride(1),
            BLOCK_NH=triton.next_power_of_2(nh), BLOCK_HALF=triton.next_power_of_2(d // 2),
        )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [T, I]
    up_ptr,  # [T, I]
    out_ptr,  # [T, I]
    n_cols,
    stride_g,
    stride_u,
    stride_o,
    BLOCK: tl.constexpr,
):
    """silu(gate) rounded to the dtype (as F.silu returns it), times up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * u).to(dt), mask=mask)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(gate) * up for [T, I] inputs with contiguous rows: [T, I]."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"silu_mul takes two [T, I] tensors, got {gate.shape} and {up.shape}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.shape[0]:
        grid = (gate.shape[0], triton.cdiv(gate.shape[1], block))
        _silu_mul_kernel[grid](
            gate, up, out, gate.shape[1], gate.stride(0), up.stride(0), out.stride(0), BLOCK=block
        )
    return out


# What the layers call on CUDA (ops/elementwise/__init__.py chooses them once per device): the
# kernels above where the inputs' layout allows, else the torch reference.


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim of ``x`` [..., H] with weight [H]: the kernel over its rows."""
    if x.stride(-1) != 1:
        return rms_norm_reference(x, weight, eps)
    return rms_norm_triton(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def rotary_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, NH, D] by cos / sin [T, D]: the kernel."""
    if x.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        return rotary_reference(x, cos, sin)
    return rotary_triton(x, cos, sin)


def silu_mul_fused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [T, I]: the kernel."""
    if gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return silu_mul_reference(gate, up)
    return silu_mul_triton(gate, up)
