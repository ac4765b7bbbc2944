"""Calibrate the cost model from measured step times stored as JSON (plain Python).

File format (see ``configs/calibration/*.json``)::

    {"hardware": "a100-40gb", "model": "opt-13b", "block_size": 16, "num_gpus": 1,
     "source": "where the times come from",
     "points": [{"num_seqs": 8, "context_tokens_per_seq": 418, "step_time_s": 0.02996}, ...]}

A point is a decode step (``num_seqs`` requests, one new token each, ``context_tokens_per_seq``
tokens of context) unless it gives ``num_new_tokens``, ``kv_tokens_read``, ``kv_blocks_read``
and ``attn_pairs`` explicitly. ``"law"`` says what the points fit (``LAWS``): ``roofline`` (the
default, a GPU): memory-bound points fit the per-iteration overhead and the achievable
bandwidth (a least-squares line, overhead >= 0); compute-bound points, if any, fit the
achievable FLOP/s. ``linear`` (a CPU): a non-negative sum of per-step, per-request, per-token
(piecewise, breaks at the file's ``token_knots``), per-KV-token and per-pair costs
(``paged_llm/sim/step_law.py``).

An optional ``"per_seq_overhead_s"`` is host time per scheduled request per step that the file
states rather than fits (``paper_repro/fit_cost_model.py`` fits it to a paper figure); the
roofline fit then prices the points with it, and the calibrated model keeps it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_llm.sim.cost_model import RooflineCostModel, StepShape
from paged_llm.sim.step_law import LinearCostModel, fit_linear_law


@dataclass(frozen=True)
class MeasuredStep:
    """One measured iteration: its shape and how long it took."""

    step: StepShape
    step_time_s: float


def _point(p: dict[str, Any], block_size: int) -> MeasuredStep:
    if "context_tokens_per_seq" in p:
        step = StepShape.decode(int(p["num_seqs"]), int(p["context_tokens_per_seq"]), block_size)
    else:
        step = StepShape(
            int(p["num_seqs"]), int(p["num_new_tokens"]), int(p["kv_tokens_read"]),
            int(p["kv_blocks_read"]), int(p["attn_pairs"]),
        )  # fmt: skip
    return MeasuredStep(step, float(p["step_time_s"]))


def load_calibration(path: str | Path) -> dict[str, Any]:
    """Read a calibration file; raise a clear error when it is missing or malformed."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"calibration file '{path}' not found")
    data = json.loads(p.read_text())
    if not data.get("points"):
        raise ValueError(f"{path}: no 'points' with measured step times")
    return data


def _names(obj_name: str, presets: dict[str, Any]) -> set[str]:
    """A preset's display name and every preset key that carries it, lower-cased."""
    return {obj_name.lower()} | {k for k, v in presets.items() if v.name == obj_name}


def _check_matches(cm: RooflineCostModel, data: dict[str, Any], path: str) -> None:
    """A calibration measured on other hardware, another model or other settings does not
    transfer; refuse it instead of silently mis-calibrating."""
    from paged_llm.sim.hardware import HARDWARE
    from paged_llm.sim.model_shapes import MODEL_SHAPES

    checks = (
        ("hardware", _names(cm.hardware.name, HARDWARE)),
        ("model", _names(cm.model.name, MODEL_SHAPES)),
    )
    for field, ok in checks:
        if field in data and str(data[field]).lower() not in ok:
            raise ValueError(
                f"calibration {path} is for {field} '{data[field]}', not {sorted(ok)}; give a "
                "calibration measured on this setup or none (executor.calibration=null)"
            )
    if "num_gpus" in data and int(data["num_gpus"]) != cm.num_gpus:
        raise ValueError(f"calibration {path} has num_gpus={data['num_gpus']}, not {cm.num_gpus}")


def fit(cm: RooflineCostModel, points: list[MeasuredStep]) -> dict[str, float]:
    """Fitted ``overhead_s`` and ``mem_efficiency`` (and ``compute_efficiency`` if any point is
    compute-bound) for the cost model's hardware and model shape."""
    bw_peak = cm.hardware.mem_bandwidth * cm.num_gpus

    def per_seq(p: MeasuredStep) -> float:  # a set per-request cost is not refitted
        return cm.per_seq_overhead_s * p.step.num_seqs

    def memory_bound(p: MeasuredStep) -> bool:
        return cm.memory_bytes(p.step) / cm.bandwidth >= cm.compute_flops(p.step) / cm.flops

    mem = [p for p in points if memory_bound(p)]
    comp = [p for p in points if not memory_bound(p)]
    params: dict[str, float] = {}
    if mem:
        # t = overhead + x / efficiency, x = bytes / peak bandwidth
        xs = [cm.memory_bytes(p.step) / bw_peak for p in mem]
        ts = [p.step_time_s - cm.allreduce_time(p.step) - per_seq(p) for p in mem]
        n = len(xs)
        mx, mt = sum(xs) / n, sum(ts) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx > 0 else 0.0
        overhead = mt - slope * mx
        if n == 1 or slope <= 0 or overhead < 0:
            # One point, or a negative intercept: keep the overhead at zero, fit through it.
            overhead = 0.0 if n > 1 or overhead < 0 else cm.overhead_s
            slope = sum(x * (t - overhead) for x, t in zip(xs, ts)) / sum(x * x for x in xs)
        params["overhead_s"] = overhead
        params["mem_efficiency"] = min(1.0, 1.0 / slope)
    if comp:
        o = params.get("overhead_s", cm.overhead_s)
        peak = cm.hardware.peak_flops * cm.num_gpus
        effs = [
            cm.compute_flops(p.step) / peak / max(1e-12, p.step_time_s - o - per_seq(p))
            for p in comp
        ]
        params["compute_efficiency"] = min(1.0, sum(effs) / len(effs))
    return params


def _calibrate_roofline(
    cm: RooflineCostModel, points: list[MeasuredStep], data: dict[str, Any]
) -> RooflineCostModel:
    # Fit at the block size the times were measured with; the fitted bandwidth and overhead
    # then apply at any block size (the per-block cost is modelled separately).
    block_size = int(data.get("block_size", cm.block_size))
    return cm.with_params(**fit(cm.with_params(block_size=block_size), points))


def _calibrate_linear(
    cm: RooflineCostModel, points: list[MeasuredStep], data: dict[str, Any]
) -> RooflineCostModel:
    knots = tuple(data.get("token_knots", ()))
    law = fit_linear_law([p.step for p in points], [p.step_time_s for p in points], knots)
    return LinearCostModel.from_roofline(cm, law)


# The step-time laws a calibration file can fit (its "law" field), by name.
LAWS = {"roofline": _calibrate_roofline, "linear": _calibrate_linear}


def calibrate(cm: RooflineCostModel, path: str | Path) -> RooflineCostModel:
    """The cost model with parameters fitted to a calibration file's measured step times."""
    data = load_calibration(path)
    _check_matches(cm, data, str(path))
    law = data.get("law", "roofline")
    if law not in LAWS:
        raise ValueError(f"{path}: unknown law '{law}'; choose one of {list(LAWS)}")
    if "per_seq_overhead_s" in data:  # stated, not fitted: it replaces the executor's value
        cm = cm.with_params(per_seq_overhead_s=float(data["per_seq_overhead_s"]))
    block_size = int(data.get("block_size", cm.block_size))
    points = [_point(p, block_size) for p in data["points"]]
    return LAWS[law](cm, points, data)


def fit_report(cm: RooflineCostModel, path: str | Path) -> list[dict[str, float]]:
    """Measured vs modelled step time of every point in a calibration file."""
    data = load_calibration(path)
    block_size = int(data.get("block_size", cm.block_size))
    rows = []
    for p in (_point(q, block_size) for q in data["points"]):
        model = cm.step_time(p.step)
        rows.append({"num_seqs": p.step.num_seqs, "measured_s": p.step_time_s, "model_s": model})
    return rows
