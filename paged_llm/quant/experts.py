"""Weight quantization of stacked mixture-of-experts weights (``layers/moe.FusedExperts``).

int8 as ``Int8Linear`` does it, per expert: symmetric absmax, one scale per output channel, so
expert e's ``W = q[e] * scale[e][:, None]``. The fused kernels read the int8 tensors and scales
directly (``ops/moe``). The routers are not touched (``RouterLinear``).
"""

from __future__ import annotations

import torch
from torch import nn


def int8_per_channel(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (int8 [E, N, K], float32 scales [E, N]) by absmax of each row."""
    w = weights.detach().float()
    scale = (w.abs().amax(dim=2) / 127).clamp(min=1e-12)  # an all-zero row keeps scale > 0
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@torch.no_grad()
def quantize_experts_int8(experts: nn.Module) -> None:
    """Replace a FusedExperts' two stacked float weights by int8 values and their scales."""
    for name in ("gate_up", "down"):
        q, scale = int8_per_channel(getattr(experts, f"{name}_proj"))
        setattr(experts, f"{name}_proj", nn.Parameter(q, requires_grad=False))
        setattr(experts, f"{name}_scale", scale.to(q.device))


def experts_weight_bytes(experts: nn.Module) -> int:
    """Bytes of a FusedExperts' weights (and scales, once quantized)."""
    tensors = [experts.gate_up_proj, experts.down_proj, experts.gate_up_scale, experts.down_scale]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
