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


def expert_weight(
    weights: torch.Tensor,  # [E, N, K] float, or int8 / fp8 e4m3 with scales
    scales: torch.Tensor | None,  # [E, N] per output channel, or None for float weights
    expert: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] in dtype
    """One expert's weight in the activations' dtype (quantized weights dequantized:
    w * scale)."""
    if scales is None:
        return weights[expert]
    return dequantize_per_channel(weights[expert], scales[expert], dtype)


def fused_experts_reference(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows (float, or int8 with scales)
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int
    gate_up_scale: torch.Tensor | None = None,  # [E, 2I] with int8 gate_up
    down_scale: torch.Tensor | None = None,  # [E, H] with int8 down
) -> torch.Tensor:  # [T, H]
    """sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t) with e = topk_ids[t, j]."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    # Sort the (token, slot) pairs by expert so each expert's rows are one contiguous run.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    top_k = topk_ids.shape[1]
    weights = topk_weights.reshape(-1).to(x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        w_gate_up = expert_weight(gate_up, gate_up_scale, expert, x.dtype)
        gate, up = F.linear(x[tokens], w_gate_up).chunk(2, dim=-1)
        w_down = expert_weight(down, down_scale, expert, x.dtype)
        y = F.linear(F.silu(gate) * up, w_down) * weights[pairs, None]
        out.index_add_(0, tokens, y)
    return out
