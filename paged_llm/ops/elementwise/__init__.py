"""Per-token elementwise ops of a decoder layer (RMSNorm, rotary embedding, SwiGLU gate): a
torch reference and fused Triton kernels. On CUDA the kernels run (one launch per op instead of
several, which matters inside a decode step); on the CPU the reference does.

Set ``PAGED_LLM_FUSED_ELEMENTWISE=0`` to run the torch reference on CUDA too (to compare, or
to rule the kernels out while debugging).
"""

from __future__ import annotations

import os

import torch

from paged_llm.ops.elementwise.reference import (
    rms_norm_reference,
    rotary_reference,
    silu_mul_reference,
)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("PAGED_LLM_FUSED_ELEMENTWISE", "1") != "0"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim of ``x`` [..., H] with weight [H]."""
    if _use_triton(x) and x.stride(-1) == 1:
        from paged_llm.ops.elementwise.triton import rms_norm_triton

        return rms_norm_triton(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    return rms_norm_reference(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, NH, D] by cos / sin [T, D]."""
    if _use_triton(x) and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
        from paged_llm.ops.elementwise.triton import rotary_triton

        return rotary_triton(x, cos, sin)
    return rotary_reference(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise over [T, I]."""
    if _use_triton(gate) and gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        from paged_llm.ops.elementwise.triton import silu_mul_triton

        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)


__all__ = ["rms_norm", "rotary", "silu_mul"]
