"""Normalisation layers. LayerNorm is torch's own (OPT uses nn.LayerNorm as is); RMSNorm follows
the LLaMA recipe: statistics in float32, the result cast back before the weight multiply."""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.ops.elementwise import BindsElementwiseOps, device_of, rms_norm_for


class RMSNorm(BindsElementwiseOps):
    """Root-mean-square norm with a learned scale (LLaMA / Mistral / Qwen2)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.bind_ops(device_of(self))

    def bind_ops(self, device: torch.device) -> None:
        """The fused RMSNorm kernel on CUDA, the torch reference elsewhere (ops/elementwise)."""
        self._rms_norm = rms_norm_for(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Normalise each row in float32, cast back to the input dtype, then scale."""
        return self._rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
