"""Mixture-of-experts in plain torch: top-k routing and the experts' gated MLPs, one expert at a
time over the tokens routed to it. The readable reference the Triton kernels are tested against,
and the CPU path (where one GEMM per expert is already the fast way)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_llm.ops.quant_matmul.reference import dequantize_per_channel


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, ids [T, k] int64
    """Softmax over the experts in float32, keep the k largest; ``renormalize`` rescales the kept
    weights to sum to one (Mixtral, Qwen3-MoE) instead of keeping their softmax mass (Qwen2-MoE)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def int4_group_tiles(group_size: int) -> bool:
    """Whether the fused kernel's K tiles can divide int4 groups of this size: a power of two
    of at least 16 (``tl.dot``'s smallest tile)."""
    return group_size >= 16 and not group_size & (group_size - 1)


def pack_int4_experts(q: torch.Tensor) -> torch.Tensor:  # [..., K] codes 0..15 -> [..., K/2]
    """Two int4 codes per byte along K: input k's code in the low nibble when k is even."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4_experts(packed: torch.Tensor) -> torch.Tensor:  # [..., K/2] -> [..., K] uint8
    """The codes of :func:`pack_int4_experts`, in input order."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize_int4_experts(
    packed: torch.Tensor,  # [N, K/2] uint8, two codes per byte
    scales: torch.Tensor,  # [N, G] float32, one per output channel and group of K / G inputs
    zeros: torch.Tensor,  # [N, G] uint8 zero points
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] in dtype
    """``(q - z) * s`` of one expert's int4 weight, computed in float32."""
    q = unpack_int4_experts(packed).float()  # [N, K]
    group = q.shape[1] // scales.shape[1]
    s = scales.float().repeat_interleave(group, dim=1)
    z = zeros.float().repeat_interleave(group, dim=1)
    return ((q - z) * s).to(dtype)


def expert_weight(
    weights: torch.Tensor,  # [E, N, K] float, int8 / fp8 e4m3 with scales, or [E, N, K/2] int4
    scales: torch.Tensor | None,  # [E, N] per output channel, [E, N, G] for int4, or None
    expert: int,
    dtype: torch.dtype,
    zeros: torch.Tensor | None = None,  # [E, N, G] uint8 zero points of int4 weights
) -> torch.Tensor:  # [N, K] in dtype
    """One expert's weight in the activations' dtype (quantized weights dequantized:
    w * scale, or (q - zero) * scale per group for int4)."""
    if scales is None:
        return weights[expert]
    if zeros is not None:
        return dequantize_int4_experts(weights[expert], scales[expert], zeros[expert], dtype)
    return dequantize_per_channel(weights[expert], scales[expert], dtype)


def fused_experts_reference(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows (float, int8 with scales, or
    # int4: [E, 2I, H/2] uint8 with group scales and zeros)
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int; -1: an expert of another rank (skipped)
    gate_up_scale: torch.Tensor | None = None,  # [E, 2I] with int8 gate_up ([E, 2I, G]: int4)
    down_scale: torch.Tensor | None = None,  # [E, H] with int8 down ([E, H, G]: int4)
    gate_up_zero: torch.Tensor | None = None,  # [E, 2I, G] uint8 with int4 gate_up
    down_zero: torch.Tensor | None = None,  # [E, H, G] uint8 with int4 down
) -> torch.Tensor:  # [T, H]
    """sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t) with e = topk_ids[t, j]."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    # Sort the (token, slot) pairs by expert so each expert's rows are one contiguous run;
    # pairs of other ranks' experts (-1) sort first and are skipped.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids + 1, minlength=gate_up.shape[0] + 1).tolist()
    top_k = topk_ids.shape[1]
    weights = topk_weights.reshape(-1).to(x.dtype)
    start = counts[0]
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        w_gate_up = expert_weight(gate_up, gate_up_scale, expert, x.dtype, gate_up_zero)
        gate, up = F.linear(x[tokens], w_gate_up).chunk(2, dim=-1)
        w_down = expert_weight(down, down_scale, expert, x.dtype, down_zero)
        y = F.linear(F.silu(gate) * up, w_down) * weights[pairs, None]
        out.index_add_(0, tokens, y)
    return out
