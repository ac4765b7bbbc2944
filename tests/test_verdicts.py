"""Acceptance verdicts: a sustained rate whose curve never crosses the latency threshold is a
bound of the rate grid, and any check built from a bound is undetermined, never a pass."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paper_repro import fig12, fig14, make_table
from paper_repro.common import compose
from paper_repro.verdicts import (
    FAIL,
    LOWER_BOUND,
    MEASURED,
    PASS,
    UNDETERMINED,
    UPPER_BOUND,
    acceptance_lines,
    check,
    merged_kind,
    rate_kind,
    rate_text,
)

THR = 0.2


def test_rate_kind_reads_where_the_curve_is():
    assert rate_kind([(1.0, 0.05), (2.0, 0.1), (3.0, 0.19)], THR) == LOWER_BOUND
    assert rate_kind([(1.0, 0.05), (2.0, 0.3)], THR) == MEASURED
    assert rate_kind([(2.0, 0.3), (1.0, 0.25)], THR) == UPPER_BOUND  # sorted by rate first
    assert rate_kind([(1.0, 0.05), (2.0, math.nan)], THR) == MEASURED  # nan: not sustained
    with pytest.raises(ValueError):
        rate_kind([], THR)


@given(st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=8))
def test_rate_kind_is_lower_bound_exactly_when_every_point_is_sustained(latencies):
    points = [(float(i + 1), lat) for i, lat in enumerate(latencies)]
    kind = rate_kind(points, THR)
    assert (kind == LOWER_BOUND) == all(lat <= THR for lat in latencies)
    assert (kind == UPPER_BOUND) == (latencies[0] > THR)


def test_merged_kind_over_seeds():
    assert merged_kind(MEASURED) == MEASURED
    assert merged_kind([MEASURED, MEASURED]) == MEASURED
    assert merged_kind([MEASURED, LOWER_BOUND, LOWER_BOUND]) == LOWER_BOUND
    assert merged_kind([UPPER_BOUND, LOWER_BOUND]) == "mixed_bounds"


def test_check_and_text():
    assert check(2.0, 1.7, ">= 1.7", True)["verdict"] == PASS
    assert check(2.0, 1.7, ">= 1.7", True)["pass"] is True
    fail = check(1.0, 1.7, ">= 1.7", False)
    assert fail["verdict"] == FAIL and fail["pass"] is False
    und = check(2.0, 1.7, ">= 1.7", True, determined=False)
    assert und["verdict"] == UNDETERMINED and und["pass"] is False  # never a pass
    assert rate_text(3.0, LOWER_BOUND) == ">= 3.00 (top of grid)"
    assert rate_text(0.0, UPPER_BOUND, lowest=0.5).startswith("< 0.50")
    assert rate_text(0.21, UPPER_BOUND, lowest=0.05).startswith("<= 0.21 (some seeds")
    assert rate_text(2.414, MEASURED) == "2.41"
    (line,) = acceptance_lines("fig12", {"paged_over_orca_max": und})
    assert line == "fig12 paged_over_orca_max: undetermined (ours 2, paper 1.7, target >= 1.7)"


def result_with(paged_kind, oracle_kind, ratio):
    pts = [{"request_rate": 1.0, "normalized_latency": 0.1}]
    return {
        "paged": {"points": pts, "max_sustained_rate": ratio, "sustained_rate_kind": paged_kind},
        "orca_oracle": {
            "points": pts, "max_sustained_rate": 1.0, "sustained_rate_kind": oracle_kind,
        },
        "ratios_vs_paged": {"orca_oracle": ratio},
    }  # fmt: skip


@pytest.mark.parametrize(
    "paged, oracle, ratio, want",
    [
        (MEASURED, MEASURED, 2.0, PASS),
        (MEASURED, MEASURED, 1.5, FAIL),
        (LOWER_BOUND, MEASURED, 2.0, UNDETERMINED),
        (MEASURED, LOWER_BOUND, 2.0, UNDETERMINED),
        (MEASURED, UPPER_BOUND, 9.0, UNDETERMINED),
    ],
)
def test_fig12_ratio_checks_need_crossings(paged, oracle, ratio, want):
    acc = fig12.ratio_checks(result_with(paged, oracle, ratio))["paged_over_orca_oracle"]
    assert acc["verdict"] == want and acc["pass"] is (want == PASS)
    assert acc["paper"] == (1.7, 2.7)


def test_fig14_ordering_undetermined_on_a_bound():
    res = result_with(LOWER_BOUND, MEASURED, 2.0)
    res["ordering_ok"] = True
    acc = fig14.acceptance({"beam_2": res}, ["beam_2"])["beam_2_ordering"]
    assert acc["verdict"] == UNDETERMINED and "paged: lower_bound" in acc["why"]


def test_fig12_grid_below_the_knee_is_undetermined(tmp_path, capsys):
    """A grid that stops before the curves cross: lower bounds, an undetermined ratio (JSON,
    printed lines and the README table alike)."""
    cfg = compose(
        "fig12",
        [
            "workload.duration_s=60",
            "rates.paged=[0.1,0.2]",
            "rates.orca_oracle=[0.1,0.2]",
            "~rates.orca_pow2",
            "~rates.orca_max",
            "~rates.static",
            "progress=false",
            "seeds=[0]",
        ],
    )
    fig12.run(cfg, tmp_path)
    d = json.loads((tmp_path / "fig12.json").read_text())
    assert d["paged"]["sustained_rate_kind"] == LOWER_BOUND
    acc = d["acceptance"]["paged_over_orca_oracle"]
    assert acc["verdict"] == UNDETERMINED and acc["pass"] is False
    out = capsys.readouterr().out
    assert "sustains >= 0.20 (top of grid)" in out
    assert "fig12 paged_over_orca_oracle: undetermined (ours 1, paper 1.7-2.7" in out
    rows = {r[0]: r for r in make_table.fig12_rows(d)}
    assert rows["Fig. 12 paged / orca_oracle"][3] == UNDETERMINED
    assert rows["Fig. 12 max sustained rate, paged (req/s)"][1].startswith(">= 0.2")
