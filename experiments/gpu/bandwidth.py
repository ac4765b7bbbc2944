"""Section 1, ``bandwidth``: device copy bandwidth and the bf16 matmul rate."""

from __future__ import annotations

from typing import Any

import torch

from experiments.common.timing import Deadline
from experiments.gpu.plans import Plan
from experiments.gpu.timing import time_op


def section_bandwidth(plan: Plan, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Device-to-device copy bandwidth and bf16 matmul throughput."""
    nbytes = plan.copy_mib * 2**20
    t_copy = _time_copy(nbytes, device, plan.timing_reps)
    n = plan.matmul_n
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    t_mm = time_op(lambda: a @ b, device, plan.timing_reps)
    return {
        "copy_bytes": nbytes,
        "copy_seconds": t_copy,
        # A copy reads and writes every byte: bandwidth counts both, as STREAM's copy does.
        "copy_bandwidth_GBps": 2 * nbytes / t_copy / 1e9,
        "matmul_n": n,
        "matmul_bf16_TFLOPs": 2 * n**3 / t_mm / 1e12,
    }


def _time_copy(nbytes: int, device: torch.device, reps: int) -> float:
    """Seconds per device-to-device copy of ``nbytes`` (the buffers are freed on return)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return time_op(lambda: dst.copy_(src), device, reps)
