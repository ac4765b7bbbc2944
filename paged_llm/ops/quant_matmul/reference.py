"""Torch reference for quantized linear layers: dequantize the weight, then one matmul.

This is also the CPU path of the quantized layers (the "emulated" path: weights are stored
quantized, and each call expands them to the activation dtype).
"""

from __future__ import annotations

import torch


def dequantize_per_channel(
    weight: torch.Tensor,  # [N, K] int8 or float8_e4m3fn
    scale: torch.Tensor,  # [N] per output channel
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K]
    """``weight * scale`` per output row, in ``dtype`` (int8 and fp8 weights alike)."""
    return (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def dequantize_int4(
    qweight: torch.Tensor,  # [K/8, N] int32, GPTQ layout
    qzeros: torch.Tensor,  # [G, N/8] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K] int32 group of each input row
    zero_offset: int,  # added to stored zeros (1 for GPTQ's zero-minus-one format)
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K]
    """``(q - z) * s`` with each input row's group taken from ``g_idx``, in ``dtype``."""
    k8, n = qweight.shape
    groups = scales.shape[0]
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=qweight.device)
    q = ((qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF).view(8 * k8, n)  # row k: nibble k%8
    z = ((qzeros.unsqueeze(-1) >> shifts) & 0xF).view(groups, n) + zero_offset  # col n: nibble n%8
    s = scales.to(torch.float32)
    if (8 * k8) % groups == 0 and torch.equal(
        g_idx, torch.arange(8 * k8, device=g_idx.device, dtype=g_idx.dtype) // (8 * k8 // groups)
    ):  # plain groups: broadcast per group instead of gathering per row
        w = (q.view(groups, -1, n) - z[:, None]).to(torch.float32) * s[:, None]
        return w.view(8 * k8, n).t().to(dtype)
    g = g_idx.long()
    return ((q - z[g]).to(torch.float32) * s[g]).t().to(dtype)


def int8_matmul_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N]
) -> torch.Tensor:  # [M, N]
    """``x @ dequant(weight).T``; the scale is applied after the matmul (same math, fewer ops)."""
    y = torch.nn.functional.linear(x, weight.to(x.dtype))
    return y * scale.to(x.dtype)


def int4_matmul_reference(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K/8, N] int32
    qzeros: torch.Tensor,  # [G, N/8] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K]
    zero_offset: int,
) -> torch.Tensor:  # [M, N]
    """``x @ dequant(W).T`` for a GPTQ-layout 4-bit weight."""
    w = dequantize_int4(qweight, qzeros, scales, g_idx, zero_offset, x.dtype)
    return torch.nn.functional.linear(x, w)
