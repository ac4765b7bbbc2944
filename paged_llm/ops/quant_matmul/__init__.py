"""Quantized linear layers' matmuls: a torch reference and Triton kernels for decode shapes.

:func:`int8_linear`, :func:`int4_linear` and :func:`fp8_decode_linear` pick the path: the Triton
kernel on CUDA when the input has few rows (decode), dequantize + matmul otherwise (prefill, and
always on the CPU).
"""

from __future__ import annotations

import torch

from paged_llm.ops.quant_matmul.reference import int4_matmul_reference, int8_matmul_reference

# Up to a decode batch the kernels (which re-read the weight once per 64 rows) beat expanding
# the whole weight to the activation dtype; prefill-sized inputs take dequantize + matmul.
DECODE_MAX_ROWS = 256


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[0] <= DECODE_MAX_ROWS


def int8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N]
) -> torch.Tensor:  # [M, N]
    """``x @ (weight * scale).T``."""
    if _use_triton(x):
        # Imported lazily so CPU-only code paths never need a working Triton backend.
        from paged_llm.ops.quant_matmul.triton import int8_matmul_triton

        return int8_matmul_triton(x, weight, scale)
    return int8_matmul_reference(x, weight, scale)


def fp8_decode_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N]
) -> torch.Tensor | None:  # [M, N], or None where the caller's own path applies
    """Weight-only ``x @ (weight * scale).T`` by the Triton kernel for decode rows on CUDA; None
    otherwise (prefill takes the scaled FP8 GEMM, the CPU the dequantizing path)."""
    if not _use_triton(x):
        return None
    from paged_llm.ops.quant_matmul.triton import fp8_matmul_triton

    return fp8_matmul_triton(x, weight, scale)


def int4_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K/8, N] int32
    qzeros: torch.Tensor,  # [G, N/8] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K]
    group_size: int,
    zero_offset: int,
    plain_groups: bool,  # g_idx[k] == k // group_size (no act-order permutation)
) -> torch.Tensor:  # [M, N]
    """``x @ dequant(W).T`` for a GPTQ-layout 4-bit weight."""
    if plain_groups and _use_triton(x):
        from paged_llm.ops.quant_matmul.triton import int4_matmul_triton

        return int4_matmul_triton(x, qweight, qzeros, scales, group_size, zero_offset)
    return int4_matmul_reference(x, qweight, qzeros, scales, g_idx, zero_offset)


__all__ = ["int8_linear", "int4_linear", "fp8_decode_linear", "DECODE_MAX_ROWS"]
