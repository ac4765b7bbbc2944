"""Compare figure results with the paper's numbers that a cost-model fit did not use.

``python -m paper_repro.held_out OUT.json fig13=DIR/fig13.json fig12=... fig14=... fig16=...``

Reads the result JSONs the figure scripts wrote (any subset) and writes, per quantity, ours
beside the paper's with the relative error: Fig. 13's batch sizes and Fig. 14 / 16's gains over
Orca (Oracle) against the paper's values (within ``TOLERANCE``, Fig. 13's criterion), Fig. 12's
gains against the paper's ranges.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from paged_llm.sim.paper_fit import held_out_errors
from paper_repro.paper_numbers import (
    FIG12_RATIO_RANGE,
    FIG13,
    FIG13_TOLERANCE,
    FIG14_GAIN_OVER_ORACLE,
    FIG16_GAIN_OVER_ORACLE,
)

TOLERANCE = FIG13_TOLERANCE
FIG14_SETTINGS = {"basic": "basic", "beam_6": "beam_6"}  # paper key -> fig14 setting
FIG16_SETTINGS = {"one_shot": "one_shot", "five_shot": "five_shot"}


def point_values(results: dict[str, dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """(ours, paper) for every quantity with a published value, keyed ``fig13/alpaca/paged``."""
    ours: dict[str, float] = {}
    paper: dict[str, float] = {}
    for w, by_policy in FIG13.items():
        for p, value in by_policy.items():
            got = results.get("fig13", {}).get(w, {}).get(p, {}).get("mean_batched_requests")
            if got is not None:
                ours[f"fig13/{w}/{p}"], paper[f"fig13/{w}/{p}"] = got, value
    for fig, table, keys in (("fig14", FIG14_GAIN_OVER_ORACLE, FIG14_SETTINGS),
                             ("fig16", FIG16_GAIN_OVER_ORACLE, FIG16_SETTINGS)):  # fmt: skip
        for key, setting in keys.items():
            got = results.get(fig, {}).get(setting, {}).get("ratios_vs_paged", {})
            if got.get("orca_oracle") is not None:
                ours[f"{fig}/{setting}/gain_over_orca_oracle"] = got["orca_oracle"]
                paper[f"{fig}/{setting}/gain_over_orca_oracle"] = table[key]
    return ours, paper


def range_checks(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Fig. 12's paged gains against the paper's published ranges."""
    out = {}
    ratios = results.get("fig12", {}).get("ratios_vs_paged", {})
    for policy, (lo, hi) in FIG12_RATIO_RANGE.items():
        if ratios.get(policy) is not None:
            v = ratios[policy]
            out[f"fig12/paged_over_{policy}"] = {"ours": v, "paper_range": [lo, hi],
                                                 "within": lo <= v <= hi}  # fmt: skip
    return out


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every held-out comparison the given figure results allow."""
    ours, paper = point_values(results)
    return {"tolerance": TOLERANCE, "points": held_out_errors(ours, paper, TOLERANCE),
            "ranges": range_checks(results)}  # fmt: skip


def main(argv: list[str]) -> None:
    """``OUT.json name=path ...``: compare and write; print one line per quantity."""
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        raise SystemExit(__doc__)
    paths = dict(a.split("=", 1) for a in argv[1:])
    results = {name: json.loads(Path(p).read_text()) for name, p in paths.items()}
    out = {**compare(results), "inputs": paths}
    Path(argv[0]).write_text(json.dumps(out, indent=2) + "\n")
    for k, v in out["points"].items():
        print(f"{k:40s} ours {v['ours']:7.2f} paper {v['paper']:7.2f} {v['relative_error']:+.0%}")
    for k, v in out["ranges"].items():
        print(f"{k:40s} ours {v['ours']:7.2f} paper {v['paper_range']} within {v['within']}")


if __name__ == "__main__":
    main(sys.argv[1:])
