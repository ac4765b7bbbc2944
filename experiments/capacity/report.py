"""The capacity plan's table and plot: deployments ranked by requests per dollar (CSV and
markdown), and the Pareto front of sustained rate against cost per hour; a Hydra callback
writes them into a sweep's directory after the last job, whichever sweeper chose the jobs."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig

RESULT = "capacity_plan.json"
COLUMNS = ("rank", "deployment", "rate", "rate_kind", "price_per_hour", "requests_per_dollar",
           "bound_per_dollar", "ttft_ms", "tpot_ms", "attainment", "pareto", "status")  # fmt: skip


def row_of(result: dict[str, Any]) -> dict[str, Any]:
    """One table row of a job's capacity_plan.json."""
    best = result.get("at_rate") or {}
    return {
        "deployment": result["label"],
        "rate": result["rate"]["text"] if "rate" in result else "-",
        "rate_value": result["rate"]["rate"] if "rate" in result else 0.0,
        "rate_kind": result["rate"]["kind"] if "rate" in result else "-",
        "price_per_hour": result["price_per_hour"],
        "requests_per_dollar": result["requests_per_dollar"],
        "bound_per_dollar": result.get("bound_per_dollar"),  # no schedule does better
        "ttft_ms": best.get("ttft_ms"),
        "tpot_ms": best.get("tpot_ms"),
        "attainment": best.get("attainment"),
        "status": result["status"],
        **{f"deployment.{k}": v for k, v in result["deployment"].items()},
    }


def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a`` sustains at least ``b``'s rate for at most its price, and is not the same point."""
    at_least = a["rate_value"] >= b["rate_value"] and a["price_per_hour"] <= b["price_per_hour"]
    same = (a["rate_value"], a["price_per_hour"]) == (b["rate_value"], b["price_per_hour"])
    return at_least and not same


def pareto(rows: Sequence[dict[str, Any]]) -> set[int]:
    """Indices of the rows no other row dominates on sustained rate (higher) and price per
    hour (lower); rows that sustain no rate are never on the front."""
    return {i for i, r in enumerate(rows)
            if r["rate_value"] > 0 and not any(dominates(o, r) for o in rows)}  # fmt: skip


def ranked(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows ranked by requests per dollar, then (pruned rows: no rate) by the bound on it, then
    the cheaper first; Pareto membership marked; a deployment with no fit ranks last."""
    rows = sorted((row_of(r) for r in results),
                  key=lambda r: (-r["requests_per_dollar"], -(r["bound_per_dollar"] or 0.0),
                                 r["price_per_hour"]))  # fmt: skip
    front = pareto(rows)
    for i, r in enumerate(rows):
        r["rank"], r["pareto"] = i + 1, i in front
    return rows


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return "-" if v is None else str(v)


def markdown(rows: Sequence[dict[str, Any]], title: str) -> str:
    """The ranked table as markdown."""
    lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]  # fmt: skip
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """The ranked rows as CSV (every field, the table's columns first)."""
    keys = list(dict.fromkeys([*COLUMNS, *(k for r in rows for k in r)]))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def plot(path: Path, rows: Sequence[dict[str, Any]], title: str) -> Path:
    """Sustained rate against price per hour, every deployment a dot, the front a line."""
    from paper_repro.common import figure

    fig, axes = figure(width=7, height=4.5)
    ax = axes[0][0]
    ok = [r for r in rows if r["rate_value"] > 0]
    ax.scatter([r["price_per_hour"] for r in ok], [r["rate_value"] for r in ok], s=12,
               alpha=0.5, label="deployment (>=: bound)")  # fmt: skip
    front = sorted((r for r in ok if r["pareto"]), key=lambda r: r["price_per_hour"])
    ax.plot([r["price_per_hour"] for r in front], [r["rate_value"] for r in front], "o-",
            color="C3", label="Pareto front")  # fmt: skip
    for r in front:
        ax.annotate(r["deployment"], (r["price_per_hour"], r["rate_value"]), fontsize=6)
    ax.set_xlabel("price per hour ($)")
    ax.set_ylabel("highest rate within the SLOs (req/s)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(out_dir: Path, results: Sequence[dict[str, Any]]) -> tuple[list[dict], list[Path]]:
    """capacity_plan.csv / .md / _pareto.png from the jobs' results; the rows and the paths."""
    rows = ranked(results)
    first = results[0]
    title = (f"{len(rows)} deployments of {first['model']} ({first['mode']}), "
             f"{first['workload']['source']} at SLO P{first['slo']['ttft_percentile']:g} TTFT "
             f"<= {first['slo']['ttft_ms']:g} ms, P{first['slo']['tpot_percentile']:g} TPOT <= "
             f"{first['slo']['tpot_ms']:g} ms")  # fmt: skip
    md = out_dir / "capacity_plan.md"
    md.write_text(markdown(rows, title))
    paths = [write_csv(out_dir / "capacity_plan.csv", rows), md,
             plot(out_dir / "capacity_plan_pareto.png", rows, title)]  # fmt: skip
    return rows, paths


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's capacity_plan.json under a sweep directory."""
    return [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob(f"*/{RESULT}"))]


class CapacityReport(Callback):
    """After a multirun (basic grid or Optuna), rank the jobs' deployments and draw the front
    in the sweep directory; the table goes to the logger's sweep group (W&B)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the report and log it."""
        from paged_llm.metrics.sweep import sweep_group

        sweep_dir = Path(config.hydra.sweep.dir)
        results = collect(sweep_dir)
        if not results:
            return
        rows, paths = write_report(sweep_dir, results)
        best = rows[0]
        print(f"capacity plan of {len(rows)} deployments: best {best['deployment']} at "
              f"{best['rate']} req/s, {best['requests_per_dollar']:.4g} requests per dollar; "
              f"{', '.join(map(str, paths))}")  # fmt: skip
        if config.get("logger") is not None:
            logger = instantiate(config.logger)
            logger.log_sweep(sweep_group(sweep_dir), "capacity-plan", rows, paths)
