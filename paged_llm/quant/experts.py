"""Weight quantization of stacked mixture-of-experts weights (``layers/moe.FusedExperts``).

int8 and fp8 (e4m3) as ``Int8Linear`` / ``Fp8Linear`` do it (``int8_per_channel`` /
``fp8_per_channel``), per expert: one scale per output channel, so expert e's
``W = q[e] * scale[e][:, None]``. The fused kernels read the quantized tensors and scales
directly (``ops/moe``). The routers are not touched (``RouterLinear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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


def experts_weight_bytes(experts: nn.Module) -> int:
    """Bytes of a FusedExperts' weights (and scales, once quantized)."""
    tensors = [experts.gate_up_proj, experts.down_proj, experts.gate_up_scale, experts.down_scale]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
