"""Real beside simulated: one row per (quantity, policy) with its error and pass/fail, the
printed table and the figure of ``paper_repro.validate_sim``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# How a simulated value's error against the real one is expressed, and in what unit.
ERRORS: dict[str, tuple[Callable[[float, float], float], str]] = {
    "relative": (lambda real, sim: sim / real - 1 if real else math.inf, "%"),
    "points": (lambda real, sim: 100 * (sim - real), "pp"),  # shares, in percentage points
}
# what the error is shown as in the table: a relative error in percent, points as they are
SHOWN = {"relative": 100.0, "points": 1.0}


@dataclass(frozen=True)
class Check:
    """How one quantity is judged: its error kind and the largest error that passes."""

    error: str  # a key of ERRORS
    tolerance: float  # relative: a fraction (0.1 = 10%); points: percentage points

    def __post_init__(self) -> None:
        if self.error not in ERRORS:
            raise ValueError(f"unknown error kind '{self.error}'; choose one of {list(ERRORS)}")

    def judge(self, real: float, sim: float) -> dict[str, Any]:
        """Error and pass/fail of one simulated value against the real one."""
        err = ERRORS[self.error][0](real, sim)
        ok = abs(err) <= self.tolerance
        return {"error": err, "error_kind": self.error, "tolerance": self.tolerance, "pass": ok}


def compare(
    part: str, quantity: str, check: Check, real: dict[str, float], sim: dict[str, float]
) -> list[dict[str, Any]]:
    """One row per policy: real and simulated value, error, tolerance, pass/fail."""
    return [
        {"figure": part, "quantity": quantity, "policy": p, "real": real[p],
         "simulated": sim[p], **check.judge(real[p], sim[p])}
        for p in real
    ]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    head = f"{'figure':7s} {'quantity':22s} {'policy':12s} {'real':>9s} {'simulated':>9s} "
    head += f"{'error':>8s} {'tolerance':>9s}  check"
    lines = [head, "-" * len(head)]
    for r in rows:
        scale, unit = SHOWN[r["error_kind"]], ERRORS[r["error_kind"]][1]
        lines.append(
            f"{r['figure']:7s} {r['quantity']:22s} {r['policy']:12s} {r['real']:9.3f} "
            f"{r['simulated']:9.3f} {scale * r['error']:+7.1f}{unit:2s}"
            f"{scale * r['tolerance']:6.1f}{unit:2s}  {'pass' if r['pass'] else 'FAIL'}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], title: str) -> Any:
    """Real and simulated bars per policy, one panel per quantity, failures marked."""
    from paper_repro.common import figure

    quantities = list(dict.fromkeys(r["quantity"] for r in rows))
    fig, axes = figure(ncols=len(quantities), width=4.2, height=3.6)
    for ax, q in zip(axes[0], quantities):
        mine = [r for r in rows if r["quantity"] == q]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["real"] for r in mine], width=0.4, label="real")
        ax.bar([x + 0.2 for x in xs], [r["simulated"] for r in mine], width=0.4,
               label="simulated", alpha=0.7)  # fmt: skip
        for x, r in zip(xs, mine):
            top = max(r["real"], r["simulated"])
            ax.text(x, top, "ok" if r["pass"] else "FAIL", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [r["policy"] for r in mine], fontsize=7, rotation=20)
        ax.set_title(f"{mine[0]['figure']}: {q}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8, y=-0.04)
    return fig
