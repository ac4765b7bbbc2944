"""Acceptance verdicts that say what a measurement can support: pass, fail or undetermined.

A sustained rate read off a latency-vs-rate sweep is a measurement only where the curve crosses
the latency threshold inside the rate grid. A curve that never crosses gives a lower bound
(">= 3.00, top of the grid"); one already above the threshold at the grid's lowest rate gives
an upper bound. A ratio built from a bound is undetermined, never a pass: widen the grid.

Every check is a dict with the measured ``value``, the ``paper``'s value, the ``target``, its
``verdict`` and ``pass`` (True only for a pass, so older readers keep working)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PASS, FAIL, UNDETERMINED = "pass", "fail", "undetermined"
# What a sustained rate is: crossed inside the grid, or a bound set by the grid's ends.
MEASURED, LOWER_BOUND, UPPER_BOUND = "measured", "lower_bound", "upper_bound"


def rate_kind(points: Sequence[tuple[float, float]], threshold: float) -> str:
    """Whether a sweep's (rate, normalized latency) points cross ``threshold`` inside the grid
    (measured), never exceed it (lower bound), or exceed it already at the lowest rate (upper
    bound). nan latency counts as above the threshold, as in max_sustained_rate."""
    pts = sorted(points)
    if not pts:
        raise ValueError("a sweep needs at least one point")
    below = [lat <= threshold for _, lat in pts]
    if all(below):
        return LOWER_BOUND
    if not below[0]:
        return UPPER_BOUND
    return MEASURED


def merged_kind(kinds: Any) -> str:
    """One kind for a mean over seeds: measured only if every seed's curve crossed; a list of
    per-seed kinds (seeds.aggregate keeps differing strings as a list) is a bound if one is."""
    if isinstance(kinds, str):
        return kinds
    bounds = {k for k in kinds if k != MEASURED}
    if not bounds:
        return MEASURED
    return bounds.pop() if len(bounds) == 1 else "mixed_bounds"


def rate_text(rate: float, kind: str, lowest: float | None = None) -> str:
    """'2.41', '>= 3.00 (top of grid)' or '< 0.50 (above threshold at the lowest rate)'
    (``lowest``: the grid's lowest rate; such a curve's sustained rate reads as 0)."""
    if kind == LOWER_BOUND:
        return f">= {rate:.2f} (top of grid)"
    if kind == UPPER_BOUND and rate > 0:  # a mean over seeds, some of them above throughout
        return f"<= {rate:.2f} (some seeds above threshold at the lowest rate)"
    if kind == UPPER_BOUND:
        return f"< {rate if lowest is None else lowest:.2f} (above threshold at the lowest rate)"
    if kind != MEASURED:
        return f"{rate:.2f} (a bound on some seeds)"
    return f"{rate:.2f}"


def sustained_text(entry: dict[str, Any]) -> str:
    """One policy's sustained rate (its result: points, max_sustained_rate, sustained_rate_kind),
    marked as a bound where its curve never crossed."""
    lowest = min(q["request_rate"] for q in entry["points"])
    kind = entry.get("sustained_rate_kind", MEASURED)
    return rate_text(entry["max_sustained_rate"], kind, lowest)


def bounds(result: dict[str, Any], policies: Sequence[str]) -> str:
    """Which of these policies' sustained rates are bounds, not crossings ('' if none)."""
    kinds = {p: result[p].get("sustained_rate_kind", MEASURED) for p in policies if p in result}
    return ", ".join(f"{p}: {k}" for p, k in kinds.items() if k != MEASURED)


def verdict(ok: bool, determined: bool = True) -> str:
    """pass / fail, or undetermined when the value rests on a bound."""
    if not determined:
        return UNDETERMINED
    return PASS if ok else FAIL


def check(value: Any, paper: Any, target: str, ok: bool, determined: bool = True,
          **extra: Any) -> dict[str, Any]:  # fmt: skip
    """One acceptance line: value, the paper's value, target, verdict (and ``pass``)."""
    v = verdict(ok, determined)
    return {"value": value, "paper": paper, "target": target, "verdict": v, "pass": v == PASS,
            **extra}  # fmt: skip


def verdict_of(entry: dict[str, Any]) -> str:
    """The verdict of a check (result files from before verdicts hold only ``pass``)."""
    return entry.get("verdict") or (PASS if entry.get("pass") else FAIL)


def _show(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, list | tuple) and all(isinstance(v, float) for v in x):
        return "-".join(f"{v:g}" for v in x)
    return str(x)


def acceptance_lines(name: str, acceptance: dict[str, dict[str, Any]]) -> list[str]:
    """'fig12 paged_over_orca_oracle: undetermined (ours 2.00, paper 1.7-2.7, target >= 1.7)'."""
    lines = []
    for key, a in acceptance.items():
        parts = [f"ours {_show(a.get('value'))}", f"paper {_show(a.get('paper', '-'))}"]
        if a.get("target") is not None:
            parts.append(f"target {_show(a['target'])}")
        if a.get("why"):
            parts.append(a["why"])
        lines.append(f"{name} {key}: {verdict_of(a)} ({', '.join(parts)})")
    return lines
