"""Mixture-of-experts: route each token to its top-k experts and sum their gated MLPs."""

from __future__ import annotations

import torch

from paged_llm.ops.moe.reference import fused_experts_reference, select_experts


def fused_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows (transformers' layout)
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int; -1: an expert on another rank (expert parallelism)
    gate_up_scale: torch.Tensor | None = None,  # [E, 2I]: gate_up is int8 / fp8, w = q * scale
    down_scale: torch.Tensor | None = None,  # [E, H]: down is int8 / fp8
    gate_up_zero: torch.Tensor | None = None,  # [E, 2I, G]: gate_up is int4 [E, 2I, H/2] uint8
    down_zero: torch.Tensor | None = None,  # [E, H, G]: down is int4 [E, H, I/2], scales [E, H, G]
) -> torch.Tensor:  # [T, H]
    """Each token's weighted sum of its experts' SwiGLU MLPs (Triton on CUDA, torch on the CPU);
    int8 / fp8 expert weights carry one scale per output channel, int4 ones a scale and a zero
    point per output channel and group of inputs."""
    scales = dict(gate_up_scale=gate_up_scale, down_scale=down_scale,
                  gate_up_zero=gate_up_zero, down_zero=down_zero)  # fmt: skip
    if x.is_cuda:
        # Imported lazily so CPU-only code paths never need a working Triton backend.
        from paged_llm.ops.moe.triton import fused_experts_triton

        return fused_experts_triton(x, gate_up, down, topk_weights, topk_ids, **scales)
    return fused_experts_reference(x, gate_up, down, topk_weights, topk_ids, **scales)


__all__ = ["fused_experts", "select_experts"]
