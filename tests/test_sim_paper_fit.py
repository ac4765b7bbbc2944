"""Fitting the cost model to the paper's numbers: each fitting step recovers known parameters
from synthetic data, and the held-out comparison is computed from the results it is given."""

import json
from pathlib import Path

import pytest

from paged_llm.sim.calibration import calibrate
from paged_llm.sim.cost_model import RooflineCostModel, StepShape
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.hardware import get_hardware
from paged_llm.sim.model_shapes import get_model_shape
from paged_llm.sim.paper_fit import (
    context_for_batch_times,
    crossing,
    held_out_errors,
    kernel_read_efficiency,
)
from paper_repro import held_out
from paper_repro.fit_cost_model import calibration_file, crossings, fig1_step_times
from paper_repro.paper_numbers import FIG13

FIT_CALIBRATION = "calibration/a100-40gb_opt-13b_paper-fit.json"


def cost(**kw):
    return RooflineCostModel(get_hardware("a100-40gb"), get_model_shape("opt-13b"), **kw)


@pytest.mark.parametrize("per_seq_s,context,overhead_s", [(0.0, 418, 1.4e-3), (3e-4, 113, 2e-3)])
def test_context_fit_recovers_the_context_and_overhead(per_seq_s, context, overhead_s):
    truth = cost(mem_efficiency=0.66, overhead_s=overhead_s, per_seq_overhead_s=per_seq_s)
    times = {b: truth.step_time(StepShape.decode(b, context)) for b in (8, 16, 24, 32, 40)}
    fit = context_for_batch_times(truth, times)
    assert fit.context_tokens == context
    assert fit.overhead_s == pytest.approx(overhead_s, rel=1e-9)
    assert fit.rms_s == pytest.approx(0, abs=1e-12)
    with pytest.raises(ValueError, match="two or more"):
        context_for_batch_times(truth, {8: 0.03})
    with pytest.raises(ValueError, match="no context length fits"):
        context_for_batch_times(truth, {8: 1e-3, 16: 2e-3})  # faster than the weights' read


def test_more_per_request_time_leaves_a_shorter_context_for_fig1():
    held = cost(mem_efficiency=0.6586)
    contexts = [context_for_batch_times(held.with_params(per_seq_overhead_s=h),
                                        fig1_step_times()).context_tokens
                for h in (0.0, 1e-4, 2e-4, 3e-4)]  # fmt: skip
    assert contexts[0] == 418  # the memory curve's reading, at no per-request time
    assert contexts == sorted(contexts, reverse=True) and contexts[-1] < 150


def test_kernel_efficiency_recovers_a_known_bandwidth():
    cm = cost(mem_efficiency=0.6)
    per_token_us = (cm.model.kv_bytes_per_token * (1 + cm.block_overhead_tokens / 16)
                    / (cm.hardware.mem_bandwidth * 0.45) / cm.model.num_layers * 1e6)  # fmt: skip
    lat = {b: {c: 20.0 + 0.5 * b + per_token_us * b * c for c in (64, 128, 256)} for b in (8, 32)}
    assert kernel_read_efficiency(cm, lat) == pytest.approx(0.45, rel=1e-9)
    with pytest.raises(ValueError, match="three or more"):
        kernel_read_efficiency(cm, {8: {64: 30.0, 128: 40.0}})


def test_crossing_interpolates_and_says_when_never_reached():
    assert crossing([0.0, 0.1, 0.3], [50.0, 70.0, 130.0], 100.0) == pytest.approx(0.2)
    assert crossing([0.0, 1.0], [5.0, 1.0], 3.0) == pytest.approx(0.5)  # decreasing too
    assert crossing([0.0, 1.0], [5.0, 6.0], 10.0) is None
    with pytest.raises(ValueError, match="increase"):
        crossing([1.0, 0.0], [1.0, 2.0], 1.5)


def test_each_bar_gets_the_per_request_time_it_needs():
    grid = [{"per_seq_overhead_ms": h, "a/paged": {"mean": m, "paper": 30.0},
             "b/paged": {"mean": 10.0 + h, "paper": 132.0}}
            for h, m in ((0.0, 20.0), (0.2, 30.0), (0.3, 35.0))]  # fmt: skip
    needs = crossings(grid, ["a/paged", "b/paged"])
    assert needs == {"a/paged": pytest.approx(0.2), "b/paged": None}


def test_calibration_states_the_per_request_time_and_fits_the_rest(tmp_path):
    truth = cost(mem_efficiency=0.66, overhead_s=1.4e-3, per_seq_overhead_s=2.5e-4)
    provenance = {"note": "synthetic"}
    data = calibration_file(truth, 2.5e-4, 164, provenance)
    data["points"] = [{**p, "step_time_s": truth.step_time(StepShape.decode(p["num_seqs"], 164))}
                      for p in data["points"]]  # fmt: skip
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    cm = calibrate(cost(per_seq_overhead_s=9e-4), path)  # the file's value replaces the executor's
    assert cm.per_seq_overhead_s == 2.5e-4
    assert cm.mem_efficiency == pytest.approx(0.66, rel=1e-6)
    assert cm.overhead_s == pytest.approx(1.4e-3, rel=1e-6)
    assert data["fit"] == provenance


def test_shipped_fit_calibration_matches_fig1_and_its_recorded_fit():
    ex = SimulatedExecutor(calibration=FIT_CALIBRATION)
    cm = ex.cost_model(16)
    data = json.loads(Path(ex.calibration).read_text())
    assert cm.per_seq_overhead_s == data["per_seq_overhead_s"] > 0
    for b, t in fig1_step_times().items():
        model = cm.step_time(StepShape.decode(b, data["points"][0]["context_tokens_per_seq"]))
        assert model == pytest.approx(t, rel=0.02)
    fit = data["fit"]  # the per-request time is where the recorded grid crosses the paper's value
    key = next(k for k in fit if k.endswith("_on_grid"))
    workload, policy = key.removesuffix("_on_grid").split("/")
    ms = crossing(fit["per_seq_grid_ms"], fit[key], FIG13[workload][policy])
    assert ms * 1e-3 == pytest.approx(data["per_seq_overhead_s"], rel=1e-9)


def test_held_out_comparison_is_computed_from_the_results():
    results = {
        "fig13": {"alpaca": {"paged": {"mean_batched_requests": 66.22}},
                  "sharegpt": {"orca_oracle": {"mean_batched_requests": 13.62}}},
        "fig12": {"ratios_vs_paged": {"orca_oracle": 1.5, "orca_max": 3.0}},
        "fig14": {"basic": {"ratios_vs_paged": {"orca_oracle": 2.6}}},
        "fig16": {"five_shot": {"ratios_vs_paged": {"orca_oracle": 3.58}}},
    }  # fmt: skip
    out = held_out.compare(results)
    pts = out["points"]
    assert pts["fig13/alpaca/paged"]["relative_error"] == pytest.approx(66.22 / 132.44 - 1)
    assert not pts["fig13/alpaca/paged"]["within"] and pts["fig13/sharegpt/orca_oracle"]["within"]
    assert pts["fig14/basic/gain_over_orca_oracle"]["relative_error"] == pytest.approx(1.0)
    assert pts["fig16/five_shot/gain_over_orca_oracle"]["relative_error"] == pytest.approx(0)
    assert set(pts) == {
        "fig13/alpaca/paged",
        "fig13/sharegpt/orca_oracle",
        "fig14/basic/gain_over_orca_oracle",
        "fig16/five_shot/gain_over_orca_oracle",
    }  # only what was given
    assert not out["ranges"]["fig12/paged_over_orca_oracle"]["within"]  # below 1.7
    assert out["ranges"]["fig12/paged_over_orca_max"]["within"]
    assert held_out_errors({"a": 2.0}, {"a": 1.0, "b": 3.0}, 0.5)["a"]["within"] is False


@pytest.mark.slow  # eight short simulated runs, ~10 s of CPU
def test_fit_experiment_runs_a_small_grid(tmp_path):
    from paper_repro import fit_cost_model
    from paper_repro.common import compose

    cfg = compose("fit_cost_model", [
        "per_seq_grid_ms=[0.0,0.3]", "seeds=[0]", "write_calibration=null",
        "workloads.alpaca.duration_s=60", "workloads.sharegpt.duration_s=60",
        "windows.alpaca=[30,60]", "windows.sharegpt=[30,60]",
    ])  # fmt: skip
    fit_cost_model.run(cfg, tmp_path)
    out = json.loads((tmp_path / "fit_cost_model.json").read_text())
    low, high = out["grid"]
    assert (low["fig1_context_tokens"], high["fig1_context_tokens"]) == (418, 113)
    assert high["alpaca/paged"]["mean"] > low["alpaca/paged"]["mean"]  # slower steps batch more
    assert set(out["per_seq_ms_each_bar_needs"]) == {
        "sharegpt/paged",
        "sharegpt/orca_oracle",
        "alpaca/paged",
        "alpaca/orca_oracle",
    }
    assert "calibration_written" not in out and (tmp_path / "fit_cost_model.png").exists()
