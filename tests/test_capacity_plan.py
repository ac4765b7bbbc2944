"""Capacity planning by simulation (issue 51): the bracketing search on rate against a known
threshold, SLO percentiles with unfinished requests, quantized shapes, the ranking and its
Pareto front, a grid and an Optuna search through Hydra's sweepers and launchers, and the
"search the search" acceptance: on a 128-deployment space Optuna finds the grid's best (within
2%) in a quarter of the grid's runs."""

import csv
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from experiments.capacity.deployment import Deployment, quantized
from experiments.capacity.evaluate import RateSearch
from experiments.capacity.rate_search import (
    SLO,
    RatePoint,
    bracket,
    fail_count,
    judge,
    percentile_inf,
)
from experiments.capacity.report import pareto, ranked
from experiments.capacity.space import apply, grid
from experiments.capacity_plan import check, evaluate
from paged_llm.metrics.serving import RequestRecord, RunTrace
from paged_llm.sim.model_shapes import get_model_shape
from paper_repro.common import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]


def _point(rate: float, meets: bool) -> RatePoint:
    return RatePoint(rate, meets, 0.0, 0.0, 1.0, rate, 1)


@settings(max_examples=200, deadline=None)
@given(
    threshold=st.floats(0.01, 2000.0),
    start=st.floats(0.1, 100.0),
    growth=st.sampled_from([1.5, 2.0, 4.0]),
    tol=st.sampled_from([0.01, 0.05, 0.2]),
    first=st.floats(0.0, 1.0),
)
def test_bracket_finds_a_known_threshold_or_says_which_bound(threshold, start, growth, tol, first):
    floor, ceiling = 0.05, 512.0
    start = min(max(start, floor), ceiling)
    step = growth ** max(first, 0.01)  # the first step's factor, in (1, growth]
    b = bracket(lambda r: _point(r, r <= threshold), start, floor, ceiling, growth, tol, step)
    if threshold >= ceiling:
        assert b.kind == "at_least" and b.rate == ceiling and b.text().startswith(">=")
    elif threshold < floor:
        assert b.kind == "below" and b.rate == 0.0 and b.upper == floor
    else:
        assert b.kind == "exact"
        assert b.rate <= threshold < b.upper and b.upper / b.rate <= 1 + tol + 1e-12
    assert all(p.meets == (p.rate <= threshold) for p in b.points)


def test_bracket_refuses_bad_settings():
    with pytest.raises(ValueError, match="floor <= start <= ceiling"):
        bracket(lambda r: _point(r, True), 1000.0, 0.1, 10.0)
    with pytest.raises(ValueError, match="growth > 1"):
        bracket(lambda r: _point(r, True), 1.0, 0.1, 10.0, growth=1.0)
    with pytest.raises(ValueError, match="first_step <= growth"):
        bracket(lambda r: _point(r, True), 1.0, 0.1, 10.0, growth=2.0, first_step=3.0)
    with pytest.raises(ValueError, match="first_guess must be > 0"):
        RateSearch(first_guess=0.0)
    with pytest.raises(ValueError, match="first_step must be in"):
        RateSearch(first_step=1.0)


def test_the_first_guess_finds_the_fixed_starts_answer_in_fewer_probes():
    """From the first guess (a share of the bound rate), the search finds the same crossing
    as from the fixed start, within the search's tolerance (both final brackets hold it), in
    fewer probes."""
    cfg, params = _config("capacity_plan_quick")
    tol = cfg["rate_search"]["rel_tol"]
    jobs = random.Random(0).sample(grid(params), 8)
    probes = {"fixed": 0, "guess": 0}
    for job in jobs:
        c = apply(cfg, job)
        fixed = evaluate(apply(c, {"rate_search.first_guess": None}))["rate"]
        guess = evaluate(c)["rate"]
        probes["fixed"] += len(fixed["points"])
        probes["guess"] += len(guess["points"])
        assert fixed["kind"] == guess["kind"]
        if guess["kind"] == "exact":  # the crossing lies in both brackets
            assert max(fixed["rate"], guess["rate"]) < min(fixed["upper"], guess["upper"])
            ratio = max(fixed["rate"], guess["rate"]) / min(fixed["rate"], guess["rate"])
            assert ratio <= 1 + tol
        else:
            assert fixed["rate"] == guess["rate"]
    assert probes["guess"] < probes["fixed"], probes


def _record(i, arrival, first=None, finished=None, out=11):
    return RequestRecord(str(i), 10, out, arrival, first_token_time=first, finished_time=finished)


def _trace(reqs, end):
    return RunTrace(reqs, [], end, "simulated", "test", "paged", 10, 16)


def test_judge_pools_requests_and_counts_unfinished_as_late():
    # 9 requests with TTFT 0.1 s and TPOT 0.01 s; one that never finished
    done = [_record(i, 0.0, 0.1, 0.2) for i in range(9)]
    slo = SLO(ttft_ms=150, tpot_ms=20, ttft_percentile=80, tpot_percentile=80)
    point = judge([_trace(done[:5], 1.0), _trace([*done[5:], _record(9, 0.0)], 1.0)], 1.0, slo)
    assert point.meets and point.num_requests == 10
    assert point.ttft_ms == pytest.approx(100.0) and point.tpot_ms == pytest.approx(10.0)
    assert point.attainment == pytest.approx(0.9)
    # at P95 the unfinished request decides: infinitely late, the SLO fails
    strict = SLO(ttft_ms=150, tpot_ms=20, ttft_percentile=95, tpot_percentile=80)
    late = judge([_trace([*done, _record(9, 0.0)], 1.0)], 1.0, strict)
    assert not late.meets and math.isinf(late.ttft_ms)


def test_percentile_inf_matches_linear_interpolation_on_finite_values():
    xs = [3.0, 1.0, 4.0, 1.5, 9.0]
    assert percentile_inf(xs, 50) == 3.0 and percentile_inf(xs, 100) == 9.0
    assert percentile_inf(xs, 90) == pytest.approx(4.0 + 0.6 * 5.0)
    assert percentile_inf([1.0, math.inf], 0) == 1.0 and math.isinf(
        percentile_inf([1.0, math.inf], 50)
    )
    assert percentile_inf([], 99) == 0.0


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), q=st.sampled_from([50.0, 90.0, 95.0, 99.0, 100.0]))
def test_fail_count_is_the_fewest_late_requests_that_lose_the_percentile(n, q):
    """That many late requests fail the percentile even if all others take no time; one fewer
    can still pass (others at 0, the late ones just over the target)."""
    k = fail_count(n, q)
    assert 1 <= k <= n
    assert percentile_inf([0.0] * (n - k) + [math.inf] * k, q) > 1000.0
    assert percentile_inf([0.0] * (n - k + 1) + [1000.001] * (k - 1), q) <= 1000.0


def test_slo_refuses_bad_targets():
    with pytest.raises(ValueError, match="> 0 ms"):
        SLO(ttft_ms=0)
    with pytest.raises(ValueError, match="percentiles"):
        SLO(tpot_percentile=120)


def test_quantized_shape_prices_weight_and_kv_bytes_separately():
    base = get_model_shape("opt-13b")
    same = quantized(base, "fp16", "auto")
    assert (
        same.weight_bytes == base.weight_bytes
        and same.kv_bytes_per_token == base.kv_bytes_per_token
    )
    assert same.weight_bytes_read(7) == base.weight_bytes_read(7)
    q = quantized(base, "int8", "fp8_e4m3")
    assert q.weight_bytes == base.weight_bytes // 2
    assert q.kv_bytes_per_token == base.kv_bytes_per_token // 2
    assert q.weight_bytes_read(7) == pytest.approx(base.weight_bytes_read(7) / 2)
    assert quantized(base, "int4", "auto").weight_bytes == base.weight_bytes // 4
    assert q.linear_flops_per_token == base.linear_flops_per_token  # the arithmetic is unchanged
    # half the KV bytes and half the weights: more than twice the blocks on one A100-40GB
    fp16 = Deployment().executor({"name": "opt-13b"}, {}).cost_model(16).num_kv_blocks()
    int8 = Deployment(weights="int8", kv_cache_dtype="fp8_e4m3").executor(
        {"name": "opt-13b"}, {}).cost_model(16).num_kv_blocks()  # fmt: skip
    assert int8 > 2 * fp16


def test_deployment_refuses_bad_input_before_work():
    with pytest.raises(ValueError, match="unknown policy"):
        Deployment(policy="nope")
    with pytest.raises(ValueError, match="weights must be one of"):
        Deployment(weights="int3")
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        Deployment(max_num_batched_tokens=512).settings({"max_model_len": 2048})
    with pytest.raises(ValueError, match="no price per GPU-hour for 'h200'"):
        Deployment(hardware="h200").price_per_hour({"a100-40gb": 1.0})
    cfg = _config("capacity_plan")[0]
    check(cfg)
    with pytest.raises(ValueError, match="unknown hardware"):
        check(apply(cfg, {"deployment.hardware": "tpu"}))


def _row(name, rate, price):
    return {"label": name, "status": "ok", "price_per_hour": price,
            "requests_per_dollar": rate * 3600 / price, "deployment": {},
            "rate": {"rate": rate, "kind": "exact", "text": f"{rate}"}}  # fmt: skip


def test_ranking_by_requests_per_dollar_and_the_pareto_front():
    results = [_row("cheap", 1.0, 1.0), _row("fast", 4.0, 8.0), _row("worse", 0.9, 2.0),
               _row("mid", 3.0, 2.0), {"label": "none", "status": "infeasible: x",
                                       "price_per_hour": 1.0, "requests_per_dollar": 0.0,
                                       "deployment": {}}]  # as evaluate: no rate  # fmt: skip
    pruned = [{**_row(name, 0.0, 1.0), "status": "pruned", "bound_per_dollar": bound}
              for name, bound in (("low bound", 5.0), ("high bound", 9.0))]  # fmt: skip
    assert [r["deployment"] for r in ranked(pruned)] == ["high bound", "low bound"]
    rows = ranked(results)
    assert [r["deployment"] for r in rows] == ["mid", "cheap", "fast", "worse", "none"]
    assert {r["deployment"] for r in rows if r["pareto"]} == {"cheap", "mid", "fast"}
    assert rows[-1]["rate"] == "-" and not rows[-1]["pareto"]
    assert pareto([]) == set()


def _config(name, overrides=()):
    """A resolved config (no hydra node) and its sweeper's search space."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        c = compose(name, overrides=list(overrides), return_hydra_config=True)
    params = OmegaConf.to_container(c.hydra.sweeper.params)
    plain = OmegaConf.to_container(c, resolve=False)
    plain.pop("hydra")
    return OmegaConf.to_container(OmegaConf.create(plain), resolve=True), params


def _capacity_plan(tmp_path, *args):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "experiments.capacity_plan", *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _rows(path):
    return list(csv.DictReader(path.read_text().splitlines()))


@pytest.fixture(scope="module")
def quick_grid():
    """Every deployment of capacity_plan_quick's space searched whole: deployment (JSON) ->
    its result."""
    cfg, params = _config("capacity_plan_quick")
    jobs = grid(params)
    assert len(jobs) >= 100
    return {json.dumps(apply(cfg, j)["deployment"], sort_keys=True): evaluate(apply(cfg, j))
            for j in jobs}  # fmt: skip


def test_optuna_finds_the_grids_best_in_a_quarter_of_its_runs(tmp_path, quick_grid):
    values = {k: r["requests_per_dollar"] for k, r in quick_grid.items()}
    best = max(values.values())
    trials = len(values) // 4
    sweep_dir = tmp_path / "optuna"
    _capacity_plan(tmp_path, "--config-name", "capacity_plan_quick", "-m",
                   "hydra/sweeper=capacity_optuna", f"hydra.sweeper.n_trials={trials}",
                   f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    found = [json.loads(p.read_text()) for p in sweep_dir.glob("*/capacity_plan.json")]
    assert len(found) == trials
    for job in found:  # each trial computed what the grid computed for its deployment
        key = json.dumps(job["deployment"], sort_keys=True)
        assert job["requests_per_dollar"] == pytest.approx(values[key])
    top = _rows(sweep_dir / "capacity_plan.csv")[0]
    assert float(top["requests_per_dollar"]) >= 0.98 * best
    assert (sweep_dir / "capacity_plan_pareto.png").stat().st_size > 0
    assert len(_rows(sweep_dir / "sweep.csv")) == trials  # the merged table of every sweep


def test_branch_and_bound_finds_the_grids_best_with_fewer_probes(tmp_path, quick_grid):
    """hydra/sweeper=capacity_bnb over 32 deployments of the same space (the command line's
    sweeps): nothing the whole grid found for them beats its winner by more than the
    brackets' resolution (rel_tol), every deployment has a row, the pruned ones a bound, and
    it simulates fewer probes than the grid did for them."""
    cfg, _ = _config("capacity_plan_quick")
    tol = cfg["rate_search"]["rel_tol"]
    sweep_dir = tmp_path / "bnb"
    _capacity_plan(tmp_path, "--config-name", "capacity_plan_quick", "-m",
                   "hydra/sweeper=capacity_bnb", "hydra.sweeper.params=null",
                   "deployment.hardware=a100-40gb,a100-80gb,h100,h200", "deployment.num_gpus=1,2",
                   "deployment.max_num_seqs=8,32", "deployment.kv_cache_dtype=auto,fp8_e4m3",
                   "deployment.policy=paged", "deployment.max_num_batched_tokens=512",
                   f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    found = [json.loads(p.read_text()) for p in sweep_dir.glob("*/capacity_plan.json")]
    assert len(found) == 32
    grid_of = {k: quick_grid[json.dumps(j["deployment"], sort_keys=True)] for j in found
               for k in [json.dumps(j["deployment"], sort_keys=True)]}  # fmt: skip
    top = _rows(sweep_dir / "capacity_plan.csv")[0]
    assert top["status"] == "ok" and top["rate_kind"] == "exact"
    winner = float(top["requests_per_dollar"])
    assert max(r["requests_per_dollar"] for r in grid_of.values()) <= winner * (1 + tol)
    kinds = {j["rate"]["kind"] for j in found if "rate" in j}
    assert {"pruned_bound", "exact"} <= kinds
    for j in found:
        key = json.dumps(j["deployment"], sort_keys=True)
        if j["status"] == "pruned":  # what the grid measured for it cannot beat the winner
            assert quick_grid[key]["requests_per_dollar"] < winner * (1 + tol)
            assert j["rate"]["text"].startswith("< ")
        elif "rate" in j:  # searched whole: a rate the SLOs hold at, within the bound
            assert j["busy_bound_share"] is None or j["busy_bound_share"] <= 1.0
    probes = lambda results: sum(len(r.get("rate", {}).get("points", [])) for r in results)  # noqa: E731
    assert probes(found) < probes(grid_of.values())


def test_grid_through_the_basic_sweeper_and_the_joblib_launcher(tmp_path):
    sweep_dir = tmp_path / "grid"
    # the command line's sweeps instead of the config's space (params=null)
    _capacity_plan(tmp_path, "--config-name", "capacity_plan_quick", "-m",
                   "hydra.sweeper.params=null", "deployment.hardware=a100-40gb,h100",
                   "deployment.num_gpus=1,2", "deployment.max_num_seqs=32",
                   "hydra/launcher=parallel", "logger=wandb",
                   f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    rows = _rows(sweep_dir / "capacity_plan.csv")
    assert len(rows) == 4 and [int(r["rank"]) for r in rows] == [1, 2, 3, 4]
    per_dollar = [float(r["requests_per_dollar"]) for r in rows]
    assert per_dollar == sorted(per_dollar, reverse=True)
    for r in rows:  # the rank's number is the rate over the price
        rate = float(r["rate_value"])
        assert float(r["requests_per_dollar"]) == pytest.approx(
            rate * 3600 / float(r["price_per_hour"])
        )
    md = (sweep_dir / "capacity_plan.md").read_text()
    assert "simulated" in md and "P90 TTFT <= 200 ms" in md
    merged = _rows(sweep_dir / "sweep.csv")
    assert {(r["deployment.hardware"], r["deployment.num_gpus"]) for r in merged} == {
        ("a100-40gb", "1"),
        ("a100-40gb", "2"),
        ("h100", "1"),
        ("h100", "2"),
    }
    assert any((tmp_path / "wandb").glob("offline-run-*"))  # W&B, as every experiment logs


def test_bench_extrapolates_from_a_sample_of_the_space(tmp_path, monkeypatch):
    """The speed bench's sample mode searches deployments drawn from the space and
    extrapolates the whole search from their mean (tiny traces: the arithmetic, not speed)."""
    from experiments.capacity import bench

    out = tmp_path / "bench.json"
    argv = ["--hours", "0.01", "--short-s", "6", "--sample", "2", "--sample-s", "4"]
    monkeypatch.setattr(sys, "argv", ["bench", *argv, "--out", str(out)])
    bench.main()
    result = json.loads(out.read_text())
    s = result["sampled"]
    assert len(s["searches"]) == 2 and s["scale"] == pytest.approx(36 / 4)
    long = [r["long_cpu_s"] for r in s["searches"]]
    assert long == pytest.approx([r["cpu_s"] * 9 for r in s["searches"]])
    assert s["search_wall_min"] == pytest.approx(sum(long) / 2 * 500 / 2 / 60)
    lo, hi = s["search_wall_min_95ci"]
    assert lo <= s["search_wall_min"] <= hi
    assert s["probes_total"] == sum(r["probes"] for r in s["searches"]) > 0
    assert result["run_info"]["mode"] == "simulated"


def test_bench_times_a_whole_search(tmp_path, monkeypatch):
    """The speed bench's search mode runs a multirun whole and records its wall and CPU time
    and what each job did (a 4-deployment branch-and-bound search: the bookkeeping)."""
    from experiments.capacity import bench

    out, sweep = tmp_path / "bench.json", tmp_path / "sweep"
    sets = ["hydra/sweeper=capacity_bnb", "hydra.sweeper.params=null",
            "deployment.hardware=a100-40gb,h100", "deployment.num_gpus=1,2"]  # fmt: skip
    argv = ["--search", "capacity_plan_quick", "--search-dir", str(sweep), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["bench", *argv, *(f"--set={s}" for s in sets)])
    bench.main()
    r = json.loads(out.read_text())
    assert r["configs"] == len(r["jobs"]) == 4 and sum(r["answers"].values()) == 4
    assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["target_wall_min"] == 30.0
    assert r["probes"] == sum(j["probes"] for j in r["jobs"])
    assert r["best"]["requests_per_dollar"] == max(j["requests_per_dollar"] for j in r["jobs"])
    assert "capacity_plan_quick" in r["command"] and r["run_info"]["mode"] == "simulated"
