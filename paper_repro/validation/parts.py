"""What each figure's part of the validation reads off a run (real or simulated alike)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_llm.metrics.serving import (
    RunTrace,
    mean_batched_requests,
    memory_shares,
    serving_metrics,
)

Window = tuple[float, float]


@dataclass(frozen=True)
class Part:
    """One figure's quantity: its name, how a trace gives it, whether runs stop at the
    window's end and need the (per-block) memory breakdown."""

    quantity: str
    read: Callable[[RunTrace, Window], float]
    stop_at_window: bool
    memory: bool = False


def _capacity(trace: RunTrace, window: Window) -> float:
    """Completed requests per second of an overloaded run: Fig. 12's sustained rate read as
    the capacity (``sustained_rate_from: capacity``), robust on short runs."""
    return serving_metrics(trace)["request_throughput"]


PARTS: dict[str, Part] = {
    "fig12": Part("sustained_rate", _capacity, stop_at_window=False),
    "fig13": Part(
        "mean_batched_requests", lambda t, w: mean_batched_requests(t.iterations, w), True
    ),
    "fig2": Part(
        "token_states", lambda t, w: memory_shares(t.iterations, w)["token_states"], True, True
    ),
}


def window_of(arrivals: list[float], fractions: list[float]) -> Window:
    """The averaging window as fractions of the arrival span (warm-up and drain left out)."""
    span = max(arrivals, default=0.0)
    return fractions[0] * span, fractions[1] * span


def diagnostics(trace: RunTrace, cost: Any) -> dict[str, Any]:
    """Where a run's time went: steps, their mean length, the time outside steps; for a real
    run that recorded its steps' shapes, what ``cost`` (the simulator's model) says they take
    over what they took (1: the calibration held during this run)."""
    its = trace.iterations
    busy = sum(i.duration for i in its)
    shapes = trace.extra.get("step_shapes")
    priced = (
        {"model_over_measured_steps": sum(map(cost.step_time, shapes)) / busy} if shapes else {}
    )
    return {
        **priced,
        "end_time_s": trace.end_time,
        "iterations": len(its),
        "mean_step_s": busy / len(its) if its else None,
        "time_in_steps": busy / trace.end_time if trace.end_time else None,
        "completed": sum(r.finished for r in trace.requests),
        "preemptions": sum(i.num_preemptions for i in its),
        "mean_batched_requests": mean_batched_requests(its),
        "num_kv_blocks": trace.num_kv_blocks,
        "wall_time_s": trace.wall_time_s,
    }
