"""Per-token elementwise ops of a decoder layer (RMSNorm, rotary embedding, SwiGLU gate): a
torch reference and fused Triton kernels. On CUDA the kernels run (one launch per op instead of
several, which matters inside a decode step); on the CPU the reference does.

The layers choose once, when their tensors are placed on a device (``BindsElementwiseOps``,
with ``rms_norm_for`` and its siblings), and then call the chosen op directly; the
``rms_norm`` / ``rotary`` / ``silu_mul`` functions choose by their input's device at each call,
for code that holds no layer (the fused MoE, tests).

Set ``PAGED_LLM_FUSED_ELEMENTWISE=0`` (before the model is loaded) to run the torch reference
on CUDA too (to compare, or to rule the kernels out while debugging).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch
from torch import nn

from paged_llm.ops.elementwise.reference import (
    rms_norm_reference,
    rotary_reference,
    silu_mul_reference,
)


def fused_on(device: torch.device | str) -> bool:
    """Whether the fused kernels run on ``device``: on CUDA, unless switched off by
    ``PAGED_LLM_FUSED_ELEMENTWISE=0``."""
    fused = os.environ.get("PAGED_LLM_FUSED_ELEMENTWISE", "1") != "0"
    return torch.device(device).type == "cuda" and fused


def device_of(module: nn.Module) -> torch.device:
    """Where a module's first parameter (else buffer) lives (meta for a module without any)."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return torch.device("meta") if first is None else first.device


class BindsElementwiseOps(nn.Module):
    """A layer that calls elementwise ops: ``bind_ops(device)`` picks them when the layer is
    built and again whenever its tensors move (``.to``, ``.to_empty``, ``.cuda``), so its
    forward calls the chosen op directly."""

    def bind_ops(self, device: torch.device) -> None:
        """Keep the ops this layer calls on ``device`` (``rms_norm_for`` and its siblings)."""
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        # Every move of a module's tensors (.to, .to_empty, .cuda, .half) comes through here.
        super()._apply(fn, recurse)
        self.bind_ops(device_of(self))
        return self


def rms_norm_for(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The RMSNorm op to run on ``device``: the fused kernel or the torch reference."""
    if fused_on(device):
        from paged_llm.ops.elementwise.triton import rms_norm_fused

        return rms_norm_fused
    return rms_norm_reference


def rotary_for(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The rotary-embedding op to run on ``device``: the fused kernel or the torch reference."""
    if fused_on(device):
        from paged_llm.ops.elementwise.triton import rotary_fused

        return rotary_fused
    return rotary_reference


def silu_mul_for(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The SwiGLU-gate op to run on ``device``: the fused kernel or the torch reference."""
    if fused_on(device):
        from paged_llm.ops.elementwise.triton import silu_mul_fused

        return silu_mul_fused
    return silu_mul_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim of ``x`` [..., H] with weight [H], by the op for x's device."""
    return rms_norm_for(x.device)(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, NH, D] by cos / sin [T, D], by the op for x's device."""
    return rotary_for(x.device)(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise over [T, I], by the op for gate's device."""
    return silu_mul_for(gate.device)(gate, up)


__all__ = [
    "BindsElementwiseOps", "device_of", "fused_on", "rms_norm", "rms_norm_for", "rotary",
    "rotary_for", "silu_mul", "silu_mul_for",
]  # fmt: skip
