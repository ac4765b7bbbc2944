"""Normalisation layers. LayerNorm is torch's own (OPT uses nn.LayerNorm as is); RMSNorm follows
the LLaMA recipe: statistics in float32, the result cast back before the weight multiply."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (LLaMA / Mistral / Qwen2)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Normalise each row in float32, cast back to the input dtype, then scale."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast before multiplying by the weight, in that order, to round exactly as HF does in bf16.
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
