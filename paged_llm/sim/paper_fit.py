"""Fitting the cost model to a paper's published numbers (plain Python, no torch).

A paper publishes decode throughput by batch size (the vLLM paper's Fig. 1) without the context
length behind it, and serving results (Fig. 13's batch sizes) that depend on a per-request host
time per step. With the achievable bandwidth held, each per-request time ``h`` leaves one
context length at which the throughput points still fit (``context_for_batch_times``); ``h``
itself is where a simulated figure crosses the paper's value (``crossing``). The held-out
figures are then compared with ``held_out_errors``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from paged_llm.sim.cost_model import RooflineCostModel, StepShape


@dataclass(frozen=True)
class ContextFit:
    """The context per request and fixed overhead that best fit decode step times by batch."""

    context_tokens: int
    overhead_s: float
    rms_s: float  # root-mean-square residual of the step times


def context_for_batch_times(
    cm: RooflineCostModel, step_times: Mapping[int, float], max_context: int = 2048
) -> ContextFit:
    """The context length (and the fixed overhead, >= 0) at which ``cm`` -- its bandwidth and
    per-request time held -- best fits decode step times given by batch size."""
    if len(step_times) < 2:
        raise ValueError("need step times at two or more batch sizes")
    base = cm.with_params(overhead_s=0.0)
    best: ContextFit | None = None
    for context in range(1, max_context + 1):
        res = [t - base.step_time(StepShape.decode(b, context, cm.block_size))
               for b, t in step_times.items()]  # fmt: skip
        overhead = sum(res) / len(res)
        if overhead < 0:  # contexts this long leave no time for the fixed overhead
            break
        rms = math.sqrt(sum((r - overhead) ** 2 for r in res) / len(res))
        if best is None or rms < best.rms_s:
            best = ContextFit(context, overhead, rms)
    if best is None:
        raise ValueError("no context length fits: the held bandwidth alone exceeds the step times")
    return best


def kernel_read_efficiency(
    cm: RooflineCostModel, latency_us: Mapping[int, Mapping[int, float]]
) -> float:
    """The achievable fraction of peak bandwidth at which the cost model's KV read (with its
    per-block overhead) takes as long as a measured attention kernel: the per-token slope c of
    a least-squares fit ``t = a + b * batch + c * batch * context`` (one layer, microseconds),
    times the layers, against the bytes of one token."""
    rows = [(1.0, float(b), float(b * c), t) for b, by_ctx in latency_us.items()
            for c, t in by_ctx.items()]  # fmt: skip
    if len(rows) < 3:
        raise ValueError("need three or more (batch, context, latency) points")
    # normal equations of the 3-parameter least squares, solved by Gaussian elimination
    m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] + [sum(r[i] * r[3] for r in rows)]
         for i in range(3)]  # fmt: skip
    for i in range(3):
        pivot = max(range(i, 3), key=lambda k: abs(m[k][i]))
        m[i], m[pivot] = m[pivot], m[i]
        if m[i][i] == 0:
            raise ValueError("the kernel points do not separate batch from batch x context")
        for k in range(3):
            if k != i:
                f = m[k][i] / m[i][i]
                m[k] = [x - f * y for x, y in zip(m[k], m[i])]
    per_token_s = m[2][3] / m[2][2] * 1e-6 * cm.model.num_layers
    token_bytes = cm.model.kv_bytes_per_token * (1 + cm.block_overhead_tokens / cm.block_size)
    return token_bytes / (cm.hardware.mem_bandwidth * cm.num_gpus * per_token_s)


def crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """Where the piecewise-linear curve through (xs, ys) first reaches ``target`` (None if it
    never does); xs increasing."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need two or more (x, y) points of equal count")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError("xs must increase")
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if (y0 - target) * (y1 - target) <= 0 and y0 != y1:
            return x0 + (target - y0) * (x1 - x0) / (y1 - y0)
        if y0 == target:
            return x0
    return None


def held_out_errors(
    ours: Mapping[str, float], paper: Mapping[str, float], tolerance: float
) -> dict[str, dict[str, float | bool]]:
    """Per quantity: our value, the paper's, the relative error and whether it is within
    ``tolerance`` (quantities the paper does not give are left out)."""
    out: dict[str, dict[str, float | bool]] = {}
    for key, value in ours.items():
        if key not in paper:
            continue
        err = value / paper[key] - 1
        out[key] = {"ours": value, "paper": paper[key], "relative_error": err,
                    "within": abs(err) <= tolerance}  # fmt: skip
    return out
