"""Seeds and confidence (paper_repro/seeds.py): the Student-t interval against hand computations,
one seed reported as having no interval, a small figure run over seeds (per-seed values,
interval, different workloads per seed, CSV rows), acceptance on the mean, and the README
table's cells and block merging."""

import csv
import json
import math

import pytest

from paper_repro import fig12, fig13, make_table
from paper_repro.common import compose
from paper_repro.paper_numbers import FIG13
from paper_repro.seeds import aggregate, seed_list, seed_rows, summarize, t_quantile

FIG13_CI = [
    "workloads.sharegpt.duration_s=40", "windows.sharegpt=[20,40]",
    "workloads.alpaca.duration_s=8", "windows.alpaca=[4,8]", "progress=false",
]  # fmt: skip


@pytest.mark.parametrize(
    "df, table", [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (29, 2.045)]
)
def test_t_quantile_matches_the_printed_table(df, table):
    assert t_quantile(df) == pytest.approx(table, abs=5e-4)


def test_summarize_by_hand():
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    # mean 3, sample sd sqrt(2.5), standard error sqrt(2.5 / 5); t(0.975, 4) = 2.7764
    half = 2.7764 * math.sqrt(2.5 / 5)
    assert s["mean"] == 3.0 and s["n"] == 5 and s["per_seed"] == [1, 2, 3, 4, 5]
    assert s["ci95_low"] == pytest.approx(3 - half, abs=1e-3)
    assert s["ci95_high"] == pytest.approx(3 + half, abs=1e-3)
    two = summarize([2.0, 4.0])  # sd sqrt(2), se 1, t(0.975, 1) = 12.706
    assert (two["ci95_low"], two["ci95_high"]) == pytest.approx((3 - 12.706, 3 + 12.706), abs=1e-3)


def test_one_seed_has_no_interval():
    s = summarize([7.0])
    assert s["mean"] == 7.0 and s["n"] == 1 and s["ci95_low"] is None and s["ci95_high"] is None
    assert summarize([1.0, math.inf])["ci95_low"] is None  # no interval around a non-finite value


def test_seed_list_forms():
    assert seed_list({"seeds": [0, 1, 2, 3, 4]}) == [0, 1, 2, 3, 4]
    assert seed_list({"seeds": 3}) == [0, 1, 2]
    assert seed_list({"workload": {"seed": 7}}) == [7]  # no seeds configured: the workload's
    for bad in (0, [], [1, 1]):
        with pytest.raises(ValueError, match="seeds"):
            seed_list({"seeds": bad})
    assert seed_list(compose("fig2")) == [0, 1, 2, 3, 4]  # simulated figures: 5 by default
    assert seed_list(compose("fig12_real")) == [0]  # real runs: one


def test_aggregate_keeps_the_layout():
    a = {"p": {"x": 1.0, "pts": [{"r": 1.0, "y": 2.0}], "ok": True, "name": "a"}, "k": 5}
    b = {"p": {"x": 3.0, "pts": [{"r": 1.0, "y": 4.0}], "ok": False, "name": "a"}, "k": 5}
    stats = {}
    mean = aggregate([a, b], stats=stats)
    assert mean == {"p": {"x": 2.0, "pts": [{"r": 1.0, "y": 3.0}], "ok": [True, False],
                          "name": "a"}, "k": 5.0}  # fmt: skip
    assert stats["p/pts/0/y"]["per_seed"] == [2.0, 4.0] and stats["p/x"]["mean"] == 2.0
    rows = seed_rows([0, 1], [[{"policy": "paged", "v": 1.0}], [{"policy": "paged", "v": 3.0}]])
    assert [r["seed"] for r in rows] == [0, 1, "mean", "ci95_low", "ci95_high"]
    assert (
        rows[2]["v"] == 2.0 and rows[3]["v"] < 2.0 < rows[4]["v"] and rows[3]["policy"] == "paged"
    )


def test_fig13_over_three_seeds(tmp_path):
    """Three seeds at CI size: per-seed values and an interval per quantity, a different
    workload per seed, CSV rows per seed plus mean / interval rows, acceptance on the mean."""
    fig13.run(compose("fig13", [*FIG13_CI, "seeds=[0,1,2]"]), tmp_path)
    d = json.loads((tmp_path / "fig13.json").read_text())
    assert d["seeds"]["seeds"] == [0, 1, 2] and d["seeds"]["n"] == 3
    s = d["seeds"]["stats"]["sharegpt/paged/mean_batched_requests"]
    assert len(s["per_seed"]) == 3 and s["n"] == 3
    assert s["ci95_low"] <= s["mean"] <= s["ci95_high"]
    assert d["sharegpt"]["paged"]["mean_batched_requests"] == pytest.approx(sum(s["per_seed"]) / 3)
    assert len(set(s["per_seed"])) > 1  # the draws differ
    sharegpt = [w for w in d["run_info"]["workloads"] if w["name"] == "sharegpt"]
    assert [w["seed"] for w in sharegpt] == [0, 1, 2]
    draws = {(w["num_requests"], round(w["mean_input_len"], 6)) for w in sharegpt}
    assert len(draws) == 3  # arrivals and sampled lengths change with the seed
    acc = d["acceptance"]["sharegpt_paged"]
    assert acc["value"] == s["mean"]
    with open(tmp_path / "fig13.csv") as f:
        rows = list(csv.DictReader(f))
    labels = [r["seed"] for r in rows if r["workload"] == "sharegpt" and r["policy"] == "paged"]
    assert labels == ["0", "1", "2", "mean", "ci95_low", "ci95_high"]
    cell = make_table.fig13_rows(d)[3][1]
    assert cell == f"{s['mean']:.2f} [{s['ci95_low']:.2f}, {s['ci95_high']:.2f}]"
    assert "3 seeds, mean [95% Student-t interval]" in make_table.source(d)


def test_acceptance_compares_the_mean():
    """Two seeds off by 30% either way fail the 15% criterion alone; their mean passes."""
    paper = FIG13["sharegpt"]["paged"]
    per_seed = [{"sharegpt": {"paged": {"mean_batched_requests": paper * f}}} for f in (0.7, 1.3)]
    assert not any(fig13.acceptance(r)["sharegpt_paged"]["pass"] for r in per_seed)
    mean = aggregate(per_seed)
    assert fig13.acceptance(mean)["sharegpt_paged"]["pass"]


def test_fig12_one_seed_says_so(tmp_path):
    over = ["workload.duration_s=20", "rates.paged=[1.0,4.0]", "rates.orca_max=[0.3,1.5]",
            "~rates.orca_pow2", "~rates.orca_oracle", "~rates.static", "progress=false",
            "seeds=[5]"]  # fmt: skip
    fig12.run(compose("fig12", over), tmp_path)
    d = json.loads((tmp_path / "fig12.json").read_text())
    assert d["seeds"] == {**d["seeds"], "seeds": [5], "n": 1, "interval": "none: one seed"}
    assert d["seeds"]["stats"]["paged/max_sustained_rate"]["ci95_low"] is None
    assert d["run_info"]["workloads"][0]["seed"] == 5
    assert "1 seed (5), no interval" in make_table.source(d)
    assert make_table.fig12_rows(d)[0][1].count("[") == 0  # plain values, no interval


def test_table_merge_keeps_figures_not_rerun():
    old = "\n**fig1** — simulated: a\n\n| x |\n\n**fig2** — simulated: old\n\n| y |\n"
    new = "\n**fig2** — simulated: new\n\n| z |\n\n**fig2** — real: r\n\n| w |\n"
    merged = make_table.merge(old, new)
    assert "**fig1** — simulated: a" in merged and "new" in merged and "old" not in merged
    assert merged.index("fig1") < merged.index("fig2** — simulated") < merged.index("real")
