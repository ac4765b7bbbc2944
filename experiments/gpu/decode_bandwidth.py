"""Section 3, ``decode_bandwidth``: the paged decode kernel's achieved bandwidth as a
fraction of the copy bandwidth."""

from __future__ import annotations

from typing import Any

import torch

from experiments.common.timing import Deadline
from experiments.gpu.plans import Plan
from experiments.gpu.timing import time_op


def decode_setup(batch, context, block_size, heads, dtype, device, shuffled=True):
    """Caches holding ``batch`` sequences of ``context`` tokens, and their decode inputs."""
    hq, hkv, d = heads
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks) if shuffled else torch.arange(num_blocks)
    tables = order.view(batch, per_seq).to(device=device, dtype=torch.int32)
    k = torch.empty(num_blocks, block_size, hkv, d, device=device, dtype=dtype).normal_()
    v = torch.empty_like(k).normal_()
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, tables, lens


def kv_bytes_read(batch: int, context: int, heads: tuple[int, int, int], dtype) -> int:
    """Bytes of K and V a decode step reads: every cached vector of every sequence, once."""
    _, hkv, d = heads
    return 2 * batch * context * hkv * d * torch.empty((), dtype=dtype).element_size()


def section_decode_bandwidth(
    plan: Plan, device: torch.device, deadline: Deadline, copy_bw: float | None
) -> dict[str, Any]:
    """Achieved K/V read bandwidth of the paged decode kernel, and its share of copy bandwidth."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, skipped = [], []
    for bs in plan.block_sizes:
        for batch in plan.decode_batches:
            for ctx in plan.decode_contexts:
                if deadline.left() <= 0:
                    skipped.append({"block_size": bs, "batch": batch, "context": ctx})
                    continue
                t = time_decode(batch, ctx, bs, plan, dtype, device, shuffled=True)
                nbytes = kv_bytes_read(batch, ctx, plan.attn_heads, dtype)
                bw = nbytes / t / 1e9
                rows.append(
                    {
                        "block_size": bs,
                        "batch": batch,
                        "context": ctx,
                        "seconds": t,
                        "kv_bytes": nbytes,
                        "achieved_GBps": bw,
                        "fraction_of_copy_bw": bw / copy_bw if copy_bw else None,
                    }
                )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "dtype": dtype,
        "heads": plan.attn_heads,
        "copy_bandwidth_GBps": copy_bw,
        "rows": rows,
        "skipped": skipped,
    }


def time_decode(batch, context, block_size, plan, dtype, device, shuffled) -> float:
    """Seconds per paged decode attention call over ``batch`` sequences of ``context`` tokens."""
    from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton

    q, k, v, tables, lens = decode_setup(
        batch, context, block_size, plan.attn_heads, dtype, device, shuffled
    )
    out = torch.empty_like(q)
    scale = plan.attn_heads[2] ** -0.5
    return time_op(
        lambda: paged_decode_attention_triton(
            q, k, v, tables, lens, scale, max_seq_len=context, out=out
        ),
        device,
        plan.timing_reps,
        graph=True,
    )
