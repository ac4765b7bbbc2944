"""Weight quantization of stacked mixture-of-experts weights (``layers/moe.FusedExperts``).

int8 and fp8 (e4m3) as ``Int8Linear`` / ``Fp8Linear`` do it (``int8_per_channel`` /
``fp8_per_channel``), per expert: one scale per output channel, so expert e's
``W = q[e] * scale[e][:, None]``. int4 as ``Int4RTN`` does it: round-to-nearest with a scale
and a zero point per output channel and group of inputs, two codes per byte along the inputs
(``ops/moe/reference.pack_int4_experts``): ``W = (q[e] - zero[e]) * scale[e]`` per group. The
fused kernels read the quantized tensors, scales and zeros directly (``ops/moe``). The routers
are not touched (``RouterLinear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paged_llm.ops.moe.reference import (
    int4_group_tiles,
    pack_int4_experts,
    unpack_int4_experts,
)
from paged_llm.quant.int4 import rtn_quantize
from paged_llm.quant.layers import fp8_per_channel, int8_per_channel


@torch.no_grad()
def quantize_experts(
    experts: nn.Module,
    per_channel: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Replace a FusedExperts' two stacked float weights by quantized values and their scales,
    made by ``per_channel`` ([..., N, K] -> (values, [..., N] scales))."""
    for name in ("gate_up", "down"):
        q, scale = per_channel(getattr(experts, f"{name}_proj"))
        setattr(experts, f"{name}_proj", nn.Parameter(q, requires_grad=False))
        setattr(experts, f"{name}_scale", scale)  # a registered buffer of FusedExperts


def quantize_experts_int8(experts: nn.Module) -> None:
    """int8 experts, one scale per output channel (quantization="int8")."""
    quantize_experts(experts, int8_per_channel)


def quantize_experts_fp8(experts: nn.Module) -> None:
    """fp8 e4m3 experts, one scale per output channel (quantization="fp8")."""
    quantize_experts(experts, fp8_per_channel)


def check_int4_expert_group(group_size: int, inputs: int, what: str) -> None:
    """Raise unless the fused kernel can tile ``inputs`` in groups of ``group_size``."""
    if not int4_group_tiles(group_size):
        raise ValueError(
            f"int4 experts need a group_size that is a power of two >= 16 (the fused kernel's "
            f"K tiles divide it), got {group_size} for {what}"
        )
    if inputs % group_size:
        raise ValueError(
            f"int4 group_size {group_size} does not divide the {inputs} inputs of {what}; "
            f"choose one that divides it (e.g. 32, 64 or 128)"
        )


def set_int4_experts(
    experts: nn.Module,
    name: str,  # "gate_up" or "down"
    codes: torch.Tensor,  # [E, N, K] integer codes 0..15
    scales: torch.Tensor,  # [E, N, G]
    zeros: torch.Tensor,  # [E, N, G] integer zero points
) -> None:
    """Store one stacked projection of a FusedExperts as int4 (two codes per byte along K)."""
    packed = pack_int4_experts(codes)  # [E, N, K/2]
    setattr(experts, f"{name}_proj", nn.Parameter(packed, requires_grad=False))
    setattr(experts, f"{name}_scale", scales.float().contiguous())
    setattr(experts, f"{name}_zero", zeros.to(torch.uint8).contiguous())


def int4_experts(experts: nn.Module, name: str) -> tuple[torch.Tensor, ...]:
    """(codes [E, N, K], scales [E, N, G], zeros [E, N, G]) of an int4 projection."""
    codes = unpack_int4_experts(getattr(experts, f"{name}_proj").detach().cpu())
    return codes, getattr(experts, f"{name}_scale").cpu(), getattr(experts, f"{name}_zero").cpu()


@torch.no_grad()
def quantize_experts_int4(experts: nn.Module, group_size: int) -> None:
    """int4 experts, round-to-nearest per output channel and group of ``group_size`` inputs
    (quantization="int4_rtn")."""
    for name in ("gate_up", "down"):
        w = getattr(experts, f"{name}_proj")  # [E, N, K]
        e, n, k = w.shape
        check_int4_expert_group(group_size, k, f"the experts' {name} projection")
        q, scales, zeros = rtn_quantize(w.reshape(e * n, k), group_size)  # scales [G, E*N]
        stacked = (t.t().reshape(e, n, -1) for t in (scales, zeros))
        set_int4_experts(experts, name, q.view(e, n, k), *stacked)


def experts_weight_bytes(experts: nn.Module) -> int:
    """Bytes of a FusedExperts' weights (and scales and zeros, once quantized)."""
    tensors = [experts.gate_up_proj, experts.down_proj, experts.gate_up_scale, experts.down_scale,
               experts.gate_up_zero, experts.down_zero]  # fmt: skip
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
