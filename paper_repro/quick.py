"""Small, simulated versions of Fig. 2, 12 and 13 (Fig. 2 / 12 / 13: 249 / 282 / 77 s on 2 CPU
cores shared with about five other jobs, 2026-12-06; alone, a fraction of that), for the
README's main job and CI. ``python -m paper_repro.quick [out_dir]`` or ``run_quick(dir)``.

Shorter traces and fewer request rates than the paper; the full-scale runs are the figure
modules themselves (see paper_repro/README.md)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from paper_repro import fig2, fig12, fig13
from paper_repro.common import compose

# (module, config name, overrides): the paper's settings with shorter traces, fewer rates and
# three seeds, each quantity a mean with its 95% interval (the figure modules run five).
QUICK = (
    (
        fig2,
        "fig2",
        ["workload.duration_s=300", "window=[100,300]", "progress=false", "seeds=[0,1,2]"],
    ),
    (
        fig12,
        "fig12",
        [
            "workload.duration_s=200",
            # each grid spans its policy's threshold crossing with room on both sides, so
            # every sustained rate is a crossing, not the grid's end (tests/test_paper_repro.py)
            "rates.paged=[1.0,1.5,2.0,2.5,3.0,4.0]",
            "rates.orca_oracle=[0.5,0.75,1.0,1.25,1.5,2.0]",
            "rates.orca_pow2=[0.25,0.5,0.75,1.0,1.25,1.5]",
            "rates.orca_max=[0.2,0.4,0.6,0.8,1.0,1.25]",
            "~rates.static",
            "progress=false",
            "seeds=[0,1,2]",
        ],
    ),
    (
        fig13,
        "fig13",
        [
            "workloads.sharegpt.duration_s=400",
            "windows.sharegpt=[200,400]",
            "workloads.alpaca.duration_s=120",
            "windows.alpaca=[60,120]",
            "progress=false",
            "seeds=[0,1,2]",
        ],
    ),
)


def run_quick(out_dir: str | Path, extra_overrides: list[str] | None = None) -> list[Path]:
    """Run the quick figures into ``out_dir``/figN; return every file written."""
    out = Path(out_dir)
    paths: list[Path] = []
    for module, name, overrides in QUICK:
        start = time.perf_counter()
        cfg = compose(name, [*overrides, *(extra_overrides or [])])
        paths += module.run(cfg, out / name)
        print(f"{name}: {time.perf_counter() - start:.0f} s")
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/paper_repro/quick")
    for p in run_quick(target, sys.argv[2:]):
        print(p)
