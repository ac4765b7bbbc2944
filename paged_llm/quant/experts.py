"""Weight quantization of stacked mixture-of-experts weights (``layers/moe.FusedExperts``).

int8 as ``Int8Linear`` does it (``int8_per_channel``), per expert: one scale per output channel, so
expert e's ``W = q[e] * scale[e][:, None]``. The fused kernels read the int8 tensors and scales
directly (``ops/moe``). The routers are not touched (``RouterLinear``).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.quant.layers import int8_per_channel


@torch.no_grad()
def quantize_experts_int8(experts: nn.Module) -> None:
    """Replace a FusedExperts' two stacked float weights by int8 values and their scales."""
    for name in ("gate_up", "down"):
        q, scale = int8_per_channel(getattr(experts, f"{name}_proj"))
        setattr(experts, f"{name}_proj", nn.Parameter(q, requires_grad=False))
        setattr(experts, f"{name}_scale", scale)  # a registered buffer of FusedExperts


def experts_weight_bytes(experts: nn.Module) -> int:
    """Bytes of a FusedExperts' weights (and scales, once quantized)."""
    tensors = [experts.gate_up_proj, experts.down_proj, experts.gate_up_scale, experts.down_scale]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
