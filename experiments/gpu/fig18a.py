"""Section 4, ``fig18a``: the paper's Fig. 18a, paged vs contiguous attention kernel latency."""

from __future__ import annotations

from typing import Any

import torch

from experiments.common.timing import Deadline
from experiments.gpu.decode_bandwidth import time_decode
from experiments.gpu.plans import Plan
from experiments.gpu.timing import time_op


def _time_sdpa(batch, context, plan, dtype, device) -> float:
    """Seconds per torch SDPA decode call over a contiguous [B, H, L, D] cache (the layout of
    FasterTransformer-style systems: the same math with no block table)."""
    import torch.nn.functional as F

    hq, hkv, d = plan.attn_heads
    q = torch.randn(batch, hq, 1, d, device=device, dtype=dtype)
    k = torch.randn(batch, hkv, context, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    gqa = {"enable_gqa": True} if hkv != hq else {}
    return time_op(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, **gqa),
        device,
        plan.timing_reps,
        graph=True,
    )


def section_fig18a(plan: Plan, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Decode attention latency: paged (shuffled blocks) vs in-order blocks vs contiguous SDPA."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bs = 16
    rows, skipped = [], []
    for batch in plan.fig18_batches:
        for ctx in plan.fig18_contexts:
            if deadline.left() <= 0:
                skipped.append({"batch": batch, "context": ctx})
                continue
            row: dict[str, Any] = {"batch": batch, "context": ctx, "block_size": bs}
            for layout, shuffled in (("paged", True), ("paged_in_order", False)):
                t = time_decode(batch, ctx, bs, plan, dtype, device, shuffled)
                row[f"{layout}_us"] = 1e6 * t
            row["contiguous_sdpa_us"] = 1e6 * _time_sdpa(batch, ctx, plan, dtype, device)
            row["paged_over_sdpa"] = row["paged_us"] / row["contiguous_sdpa_us"]
            row["paged_over_in_order"] = row["paged_us"] / row["paged_in_order_us"]
            rows.append(row)
    return {
        "dtype": dtype,
        "heads": plan.attn_heads,
        "rows": rows,
        "skipped": skipped,
        "paper": "Fig. 18a: vLLM's paged kernel is 20-26% slower than FasterTransformer's",
    }
