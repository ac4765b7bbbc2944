"""Rotary position embedding (RoPE) in the "rotate half" layout HF uses for LLaMA-family models.

Partial rotary (GPT-NeoX / Pythia's ``rotary_pct``, ``partial_rotary_factor``) rotates only the
first ``rotary_dim`` channels of each head and passes the rest through. The RoPE settings of a
config and the frequencies of each rope type (scaling variants) are layers/rope_scaling.py's.

cos/sin are computed on the fly from float32 inverse frequencies (as HF does) rather than from a
precomputed table, so positions are exact for any context length and nothing large is cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paged_llm.layers.rope_scaling import compute_inv_freq
from paged_llm.ops.elementwise import rotary


class RotaryEmbedding(nn.Module):
    """Turns absolute positions into the cos/sin tables that :func:`apply_rotary` consumes."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_type = params["rope_type"]
        # A plain-attribute float32 master copy: Module.to(dtype) casts every floating buffer, and
        # bf16 frequencies would visibly shift the angles at large positions (see _apply).
        self._inv_freq_fp32 = compute_inv_freq(head_dim, params)
        self.register_buffer("inv_freq", self._inv_freq_fp32.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Whatever .to()/.half()/.to_empty() did, keep exact float32 frequencies on the new device.
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        return self

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T] -> ([T, R], [T, R]), R = rotary dim
        """cos and sin of position * frequency, computed in float32 and cast to ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]: both halves share each frequency
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, R], R <= D
    sin: torch.Tensor,  # [T, R]
    rotate: Callable[..., torch.Tensor] = rotary,  # a layer's op (ops/elementwise.rotary_for)
) -> torch.Tensor:  # [T, H, D]
    """Rotate the first R channels of every head of ``x`` by its token's angles (a fused
    kernel on CUDA); the other D - R channels pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return rotate(x, cos, sin)
    rotated = rotate(x[..., :rotary_dim].contiguous(), cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def apply_rotary_qk(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # [T, R]
    sin: torch.Tensor,  # [T, R]
    rotate: Callable[..., torch.Tensor] = rotary,  # a layer's op (ops/elementwise.rotary_for)
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hk, D]
    """``apply_rotary`` to q and k: one launch when k's heads follow q's in memory (columns of
    one merged q/k/v projection, ``layers/linear.py``), two otherwise."""
    both = _heads_side_by_side(q, k)
    if both is None:
        return apply_rotary(q, cos, sin, rotate), apply_rotary(k, cos, sin, rotate)
    out = apply_rotary(both, cos, sin, rotate)
    return out[:, : q.shape[1]], out[:, q.shape[1] :]


def _heads_side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hk, D] view when k's first head sits right after q's last in
    every row (same storage and strides, contiguous heads); else None."""
    t, hq, d = q.shape
    if (
        k.dim() != 3
        or k.shape[0] != t
        or k.shape[2] != d
        or q.dtype != k.dtype
        or q.stride() != k.stride()
        or q.stride()[1:] != (d, 1)
        or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        or k.storage_offset() != q.storage_offset() + hq * d
    ):
        return None
    return q.as_strided((t, hq + k.shape[1], d), q.stride(), q.storage_offset())
