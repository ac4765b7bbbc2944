"""Batched multi-LoRA: add each token's own adapter update ``(x A^T) B^T`` to a layer's output."""

from __future__ import annotations

import torch

from paged_llm.ops.lora.reference import add_lora_reference, slot_groups


def add_lora(
    y: torch.Tensor,  # [T, N] base layer output, updated in place
    x: torch.Tensor,  # [T, K] layer input
    lora_a: torch.Tensor,  # [S, R, K] A of each adapter slot (rank padded with zero rows)
    lora_b: torch.Tensor,  # [S, N, R] B of each slot, scaling folded in (padded columns zero)
    token_slots: torch.Tensor,  # [T] int slot of each token's adapter, -1 = none
    groups: list[tuple[int, torch.Tensor | None]] | None = None,  # CPU: slot_groups(token_slots)
) -> torch.Tensor:
    """Add each token's adapter update to ``y`` in place and return y (Triton on CUDA; on the
    CPU two GEMMs per adapter, over the rows ``groups`` gives, computed once per step)."""
    if y.is_cuda:
        # Imported lazily so CPU-only code paths never need a working Triton backend.
        from paged_llm.ops.lora.triton import add_lora_triton

        return add_lora_triton(y, x, lora_a, lora_b, token_slots)
    return add_lora_reference(y, x, lora_a, lora_b, token_slots, groups)


__all__ = ["add_lora", "slot_groups"]
