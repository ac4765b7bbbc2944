"""Fig. 2, 12 and 13 on the real engine in one command, within one time budget.

    python -m paper_repro.real_figures device=cuda model=opt-13b budget_s=360 \\
        run_policies=[paged,orca_oracle] [figures=fig2,fig13]

Every override is passed to each figure's ``fig*_real`` config; ``budget_s`` is split between
the figures by their number of engine runs (each figure then sizes its runs, probes included,
to fit its share: paper_repro/real_mode.py). Results go to ``<out>/fig2``, ``fig12``, ``fig13``
and a ``real_figures.json`` index with the time each took.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from paper_repro import fig2, fig12, fig13
from paper_repro.common import compose
from paper_repro.real_mode import keep_policies, num_runs

FIGURES = {
    "fig2": (fig2, "fig2_real"),
    "fig12": (fig12, "fig12_real"),
    "fig13": (fig13, "fig13_real"),
}


def split_budget(budget_s: float, configs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each figure's share of ``budget_s``, in proportion to its engine runs."""
    runs = {name: num_runs(keep_policies(copy.deepcopy(c))) for name, c in configs.items()}
    total = sum(runs.values())
    return {name: budget_s * n / total for name, n in runs.items()}


def run_all(
    overrides: list[str], out_dir: str | Path, budget_s: float | None = None,
    figures: list[str] | None = None,
) -> Path:  # fmt: skip
    """Run the real figures (all three, or ``figures``) with these overrides; return the index
    file's path."""
    out = Path(out_dir)
    names = figures or list(FIGURES)
    unknown = sorted(set(names) - set(FIGURES))
    if unknown:
        raise ValueError(f"figures {unknown} unknown; choose from {list(FIGURES)}")
    configs = {name: compose(FIGURES[name][1], overrides) for name in names}
    plain = {n: OmegaConf.to_container(c, resolve=True) for n, c in configs.items()}
    shares = split_budget(budget_s, plain) if budget_s else {}
    index: dict[str, Any] = {"overrides": overrides, "budget_s": budget_s, "figures": {}}
    for name in names:
        module, cfg = FIGURES[name][0], plain[name]
        if name in shares:
            cfg["budget_s"] = shares[name]
        start = time.perf_counter()
        paths = module.run(cfg, out / name)
        index["figures"][name] = {
            "budget_s": shares.get(name),
            "wall_s": time.perf_counter() - start,
            "files": [str(p) for p in paths],
        }
    path = out / "real_figures.json"
    path.write_text(json.dumps(index, indent=2))
    print(f"real figures: {path}")
    return path


def main(argv: list[str]) -> None:
    """``python -m paper_repro.real_figures [budget_s=S] [out=DIR] [figures=fig2,fig13]
    [overrides...]``."""
    own = dict(a.split("=", 1) for a in argv if a.startswith(("budget_s=", "out=", "figures=")))
    overrides = [a for a in argv if not a.startswith(("budget_s=", "out=", "figures="))]
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    budget = float(own["budget_s"]) if "budget_s" in own else None
    figures = own["figures"].split(",") if "figures" in own else None
    run_all(overrides, own.get("out", f"outputs/paper_repro/real_figures/{stamp}"), budget, figures)


if __name__ == "__main__":
    main(sys.argv[1:])
