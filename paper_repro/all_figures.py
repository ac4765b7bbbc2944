"""Every simulated figure over seeds in one command, each one's wall time recorded, and the
README's results table regenerated from what ran.

``python -m paper_repro.all_figures [--figures fig2,fig12] [--seeds 5] [--out DIR]
[--no-table] [OVERRIDE ...]`` runs each figure's defaults (five seeds, the shipped ShareGPT
trace) into ``DIR/figN`` (default ``outputs/paper_repro/all/<date_time>``), writes
``DIR/all_figures.json`` (per figure: wall seconds, command, files; the machine), stamps each
figure's wall time into its JSON's ``run_info`` (make_table prints it under the figure's
block) and, unless ``--no-table``, rewrites the figures' blocks of paper_repro/README.md.
OVERRIDEs (Hydra syntax) go to every figure.

Wall time for five seeds, measured on 2 CPU cores shared with other jobs (2026-12-06): Fig. 1
121 s, Fig. 2 169 s, Fig. 12 465 s, Fig. 13 462 s, Fig. 15 924 s, Fig. 16 1690 s, Fig. 17 1092 s,
Fig. 18b 755 s, Fig. 19 103 s (docs/results/all_figures-2026-12-06-*-cpu.json); each block of
paper_repro/README.md names its own. Fig. 14, the longest (7 settings x 4 policies x rate
sweeps), took 6660 s for five seeds (~17 CPU min per seed; one process, sharing 2 cores). Fig. 19
measures real swap and recompute times once per block size (a timing, not a random draw), so
it runs once."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from paged_llm.metrics.run_info import cpu_name, run_info
from paper_repro import make_table
from paper_repro.common import compose, module_command

# In order of cost (cheapest first), so an interrupted run has the cheap figures done.
FIGURES = ("fig1", "fig2", "fig17", "fig13", "fig12", "fig15", "fig16", "fig19", "fig18b",
           "fig14")  # fmt: skip
# Figures whose result is one measurement, not a mean over seeds (no ``seeds`` override).
ONE_RUN = {"fig19"}


def figure_overrides(name: str, seeds: int, extra: list[str]) -> list[str]:
    """The overrides one figure runs with: no progress bars, the seed count, the extras."""
    over = ["progress=false"]
    if name not in ONE_RUN:
        over.append(f"seeds={seeds}")
    return [*over, *extra]


def run_figure(name: str, overrides: list[str], out: Path) -> dict[str, Any]:
    """Run one figure into ``out``; stamp its wall time and command into its JSON."""
    module = importlib.import_module(f"paper_repro.{name}")
    start = time.perf_counter()
    mode = None
    paths = module.run(compose(name, overrides), out)
    wall = time.perf_counter() - start
    command = " ".join(["python -m", f"paper_repro.{name}", *overrides])
    result = out / f"{name}.json"
    if result.is_file():
        d = json.loads(result.read_text())
        d.setdefault("run_info", {}).update(
            wall_time_s=round(wall, 1), command=command, run_by="python -m paper_repro.all_figures",
            # other processes stretch wall time: the 1-min load average at the end, and the cores
            load_average_1m=round(os.getloadavg()[0], 2), cpus=os.cpu_count(),
        )  # fmt: skip
        result.write_text(json.dumps(d, indent=2))
        mode = d["run_info"].get("mode")
    print(f"{name}: {wall:.0f} s wall ({command})", flush=True)
    files = [str(p) for p in paths]
    return {"wall_time_s": round(wall, 1), "mode": mode, "command": command, "files": files}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: which figures, seeds, output directory; returns the summary written."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--figures", default=",".join(FIGURES), help="comma-separated, in order")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per figure (0..n-1)")
    ap.add_argument("--out", default=None, help="output directory")
    ap.add_argument("--no-table", action="store_true", help="leave the README table alone")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every figure")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.figures.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIGURES]
    if unknown or args.seeds < 1:
        raise SystemExit(f"unknown figures {unknown} (choose from {list(FIGURES)}) or seeds < 1")
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out or f"outputs/paper_repro/all/{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    info = run_info("per figure", hardware=f"{cpu_name()} (CPU)")
    summary: dict[str, Any] = {
        # each figure's JSON says whether it is real or simulated (fig19 measures both)
        "run_info": {
            **info,
            "command": module_command(info["command"]),
            # wall times depend on what else the machine runs: its load when this started
            "cpus": os.cpu_count(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        },
        "seeds": args.seeds,
        "figures": {},
    }
    start = time.perf_counter()
    for name in names:
        over = figure_overrides(name, args.seeds, args.overrides)
        summary["figures"][name] = run_figure(name, over, out / name)
        summary["total_wall_time_s"] = round(time.perf_counter() - start, 1)
        (out / "all_figures.json").write_text(json.dumps(summary, indent=2))
    print(f"all figures: {summary['total_wall_time_s']:.0f} s wall; {out / 'all_figures.json'}")
    if not args.no_table:
        make_table.main([str(out / n) for n in names])
    return summary


if __name__ == "__main__":
    main()
