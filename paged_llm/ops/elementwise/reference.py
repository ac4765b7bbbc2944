"""Torch reference for the per-token elementwise ops of a decoder layer: RMSNorm, rotary
embedding and the SwiGLU gate. Each rounds exactly as transformers does in bf16/fp16, so the
fused Triton kernels beside them are tested bit for bit (up to the last float32 ulp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    """Normalise each row in float32, cast back to the input dtype, then scale (LLaMA's order)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # Cast before multiplying by the weight, in that order, to round exactly as HF does in bf16.
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map (x1, x2) halves of the last dim to (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> torch.Tensor:  # [T, H, D]
    """Rotate every head of ``x`` by its token's angles (the half-split "NeoX" layout)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [T, I] each
    """SwiGLU's gate: silu(gate) * up."""
    return F.silu(gate) * up
