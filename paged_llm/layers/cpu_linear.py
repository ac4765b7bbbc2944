"""CPU linear layers through oneDNN's matmul.

PyTorch's CPU build runs ``nn.Linear`` through MKL. On this project's 2-core AMD EPYC (AVX-512),
for the engine's models (weights streamed from memory every step) oneDNN's matmul, which PyTorch
ships as well, was faster at every input size measured: 1.01-1.24x on one thread and 1.01-1.94x
on two (``python -m experiments.cpu_matmul``, table in docs/benchmarks.md, "CPU matmuls"). For
a model small enough to stay in cache (the 2.2M-parameter draft) MKL's lower per-call cost wins
up to 64 rows, so the draft model keeps torch's default. ``min_rows`` keeps inputs with fewer
rows on torch's default too (engine option ``cpu_onednn_min_rows``; None: no oneDNN at all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.utils.cpu import native_bf16


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's fused linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` whose inference forward on inputs of >= ``min_rows`` rows calls oneDNN."""

    min_rows: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        """``x @ W.T + b``; oneDNN for large inputs, torch's default otherwise (and for
        autograd, which oneDNN's op does not support)."""
        rows = x.numel() // max(1, x.shape[-1])
        if rows < self.min_rows or (
            torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        ):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN's linear runs on this CPU: float32, and bfloat16 only where the CPU
    has it natively (elsewhere oneDNN has no bf16 primitive and the op raises). fp16 lacks
    kernels on most CPUs."""
    return (torch.float32, torch.bfloat16) if native_bf16() else (torch.float32,)


def use_onednn_linears(model: nn.Module, min_rows: int | None) -> int:
    """Switch every plain CPU ``nn.Linear`` of a supported dtype to ``OneDnnLinear`` (same
    parameters; ``min_rows`` None leaves the model alone); return how many were switched."""
    if min_rows is None or not onednn_available():
        return 0
    switched, dtypes = 0, onednn_dtypes()
    for module in model.modules():
        if type(module) is not nn.Linear:  # subclasses (tensor parallel, quantized) keep theirs
            continue
        if module.weight.device.type == "cpu" and module.weight.dtype in dtypes:
            # Changing the class in place keeps parameters, tied weights and names intact.
            module.__class__ = OneDnnLinear
            module.min_rows = min_rows
            switched += 1
    return switched
