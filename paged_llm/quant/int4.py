"""Group-wise asymmetric 4-bit quantization math shared by RTN, GPTQ and AWQ.

Each group of ``group_size`` consecutive input features of an output row gets a scale ``s``
and an integer zero point ``z``: ``q = clamp(round(w / s) + z, 0, 15)``, ``w ~ (q - z) * s``.
"""

from __future__ import annotations

import torch

MAXQ = 15  # 4 bits


def minmax_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point covering each row of ``w`` [R, g] (zero always in range): [R], [R].

    Scales are rounded to float16 here because that is how checkpoints store them, so that
    GPTQ's error feedback and AWQ's search see the exact weights inference will use. Zero
    points are kept >= 1 because the GPTQ format stores ``z - 1`` in four bits; z would only
    be 0 for a group with no negative weight, where this costs at most one step at its max.
    """
    wmin = w.amin(dim=1).clamp(max=0)
    wmax = w.amax(dim=1).clamp(min=0)
    scale = ((wmax - wmin) / MAXQ).clamp(min=1e-6).half().float()
    zero = torch.round(-wmin / scale).clamp(1, MAXQ)
    return scale, zero


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..15 of ``w`` [R, C] for per-row ``scale`` / ``zero`` [R]."""
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, MAXQ)


def rtn_quantize(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of ``w`` [N, K]: (codes [N, K], scales [G, N], zeros [G, N])."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    flat = groups.reshape(-1, group_size)
    scale, zero = minmax_params(flat)
    q = quantize_with(flat, scale, zero).reshape(n, k)
    return q, scale.view(n, -1).t().contiguous(), zero.view(n, -1).t().contiguous()


def dequantize_codes(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``(q - z) * s`` for codes [N, K] and per-group scales / zeros [G, N]: [N, K] float32."""
    s = scales.t().repeat_interleave(group_size, dim=1)  # [N, K]
    z = zeros.t().repeat_interleave(group_size, dim=1)
    return (q.float() - z) * s


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` [N, K] after an int4 round trip (what RTN would compute with): [N, K] float32."""
    return dequantize_codes(*rtn_quantize(w, group_size), group_size)
