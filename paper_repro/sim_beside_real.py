"""The simulator's prediction of a real run, beside it: each real figure of a directory run
again in simulation with the same settings, pool, rates, durations and windows.

    python -m paper_repro.sim_beside_real outputs/.../real_figures/<stamp> [hardware=h200] [seeds=5]

The simulated twin prices the real run's model (its shape, read from the checkpoint or preset:
``SimulatedExecutor(model={checkpoint: ...})``) on ``hardware`` with the data-sheet roofline
(configs/executor/simulated.yaml's efficiencies), or with ``calibration=<json>``. It writes
``<dir>/sim_<hardware>/figN/*`` and ``sim_beside_real.{json,md}``: per quantity the real value,
the simulated mean and 95% interval over the seeds, and the relative difference.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from paper_repro import fig2, fig12, fig13
from paper_repro.common import compose
from paper_repro.seeds import value_at

MODULES = {"fig2": fig2, "fig12": fig12, "fig13": fig13}
# What each figure is compared on: result path -> label (the path's last key is the quantity).
COMPARED = {
    "fig2": lambda r: {f"{p}/token_states": f"Fig. 2 token states, {p}" for p in _policies(r)},
    "fig12": lambda r: {
        f"{p}/saturation_throughput": f"Fig. 12 capacity (req/s), {p}" for p in _policies(r)
    },
    "fig13": lambda r: {
        f"{w}/{p}/mean_batched_requests": f"Fig. 13 batched requests, {w}, {p}"
        for w in r["config"]["workloads"]
        for p in r["config"]["policies"]
    },
}


def _policies(result: dict[str, Any]) -> list[str]:
    return [p for p in result["config"]["policies"] if p in result]


def simulated_twin(real_cfg: dict[str, Any], hardware: str, seeds: int, calibration: str | None):
    """The real run's resolved config with a simulated executor of its model on ``hardware``;
    its rates, pool and run lengths stay as the real run used them (no probe, no budgets)."""
    cfg = copy.deepcopy(real_cfg)
    model = cfg["executor"]["model"]
    dtype_bytes = 4 if model.get("dtype") == "float32" else 2
    sim = compose("paper_base", ["executor=simulated", f"hardware={hardware}"])
    cfg["executor"] = {
        "_target_": "paged_llm.sim.executor.SimulatedExecutor",
        "hardware": {"name": hardware},
        "model": {"checkpoint": model["model"], "dtype_bytes": dtype_bytes},
        "cost": dict(sim.executor.cost),
        "calibration": calibration,
    }
    for key in ("probe", "kv_budget_of", "budget_s", "run_policies"):
        cfg.pop(key, None)
    if cfg.get("sustained_rate_from") == "capacity_cpu_time":  # a virtual clock has no tenants
        cfg["sustained_rate_from"] = "capacity"
    cfg["seeds"] = list(range(seeds))
    return cfg


def compare(real_dir: Path, hardware: str = "h200", seeds: int = 5,
            calibration: str | None = None) -> Path:  # fmt: skip
    """Simulate every figure of ``real_dir``; write the side-by-side JSON and markdown."""
    out = real_dir / f"sim_{hardware}"
    rows = []
    for name, module in MODULES.items():
        found = sorted(real_dir.glob(f"**/{name}.json"))
        found = [p for p in found if out not in p.parents]
        if not found:
            continue
        real = json.loads(found[0].read_text())
        module.run(simulated_twin(real["config"], hardware, seeds, calibration), out / name)
        sim = json.loads((out / name / f"{name}.json").read_text())
        stats = sim["seeds"]["stats"]
        for path, label in COMPARED[name](real).items():
            r, s = value_at(real, path), stats.get(path)
            mean = s["mean"] if s else value_at(sim, path)
            rows.append({
                "quantity": label, "real": r, "simulated_mean": mean,
                "ci95": [s["ci95_low"], s["ci95_high"]] if s else [None, None],
                "relative_difference": (mean / r - 1) if r and mean is not None else None,
            })  # fmt: skip
    info = {"real_dir": str(real_dir), "hardware": hardware, "seeds": seeds,
            "calibration": calibration, "rows": rows}  # fmt: skip
    (real_dir / "sim_beside_real.json").write_text(json.dumps(info, indent=2))
    md = real_dir / "sim_beside_real.md"
    md.write_text(markdown(rows, hardware, seeds))
    print(md.read_text())
    return md


def markdown(rows: list[dict[str, Any]], hardware: str, seeds: int) -> str:
    """The side-by-side table."""
    lines = [
        f"| quantity | real | simulated on {hardware} (mean [95% interval], {seeds} seeds) "
        "| sim / real - 1 |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["ci95"]
        interval = f" [{lo:.3g}, {hi:.3g}]" if lo is not None else ""
        diff = r["relative_difference"]
        lines.append(
            f"| {r['quantity']} | {_num(r['real'])} | {_num(r['simulated_mean'])}{interval} | "
            f"{'-' if diff is None else f'{100 * diff:+.1f}%'} |"
        )
    return "\n".join(lines) + "\n"


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def main(argv: list[str]) -> None:
    """``python -m paper_repro.sim_beside_real DIR [hardware=h200] [seeds=5] [calibration=F]``."""
    opts = dict(a.split("=", 1) for a in argv[1:])
    compare(Path(argv[0]), opts.get("hardware", "h200"), int(opts.get("seeds", 5)),
            opts.get("calibration"))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
