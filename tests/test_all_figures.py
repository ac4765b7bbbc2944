"""paper_repro.all_figures (every figure over seeds, wall times recorded, the README table
rewritten) at the smallest scale, and the real Fig. 12 at fixed request rates (the paper's
method) beside the capacity probe."""

import json

import pytest

from paper_repro import all_figures, make_table
from paper_repro.common import compose


def test_all_figures_records_wall_time_and_seeds(tmp_path, capsys):
    out = tmp_path / "all"
    summary = all_figures.main(
        ["--figures", "fig1", "--seeds", "2", "--out", str(out), "--no-table", "batch_sizes=[8]"]
    )
    entry = summary["figures"]["fig1"]
    assert entry["wall_time_s"] > 0 and entry["mode"] == "simulated"
    assert entry["command"] == "python -m paper_repro.fig1 progress=false seeds=2 batch_sizes=[8]"
    assert json.loads((out / "all_figures.json").read_text()) == summary
    d = json.loads((out / "fig1" / "fig1.json").read_text())
    assert d["seeds"]["n"] == 2
    assert d["run_info"]["wall_time_s"] == entry["wall_time_s"]
    assert d["run_info"]["command"] == entry["command"]
    block = make_table.table([("fig1", out / "fig1" / "fig1.json")])
    assert "2 seeds, mean [95% Student-t interval]" in block
    assert f"; {entry['wall_time_s']:.0f} s wall on " in block
    assert "fig1: " in capsys.readouterr().out


def test_all_figures_refuses_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="unknown figures"):
        all_figures.main(["--figures", "fig99", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="seeds < 1"):
        all_figures.main(["--figures", "fig1", "--seeds", "0", "--out", str(tmp_path)])


def test_figure_overrides():
    assert all_figures.figure_overrides("fig2", 5, ["a=1"]) == ["progress=false", "seeds=5", "a=1"]
    # Fig. 19 is one measurement per block size: no seeds override
    assert all_figures.figure_overrides("fig19", 5, []) == ["progress=false"]


def test_fig12_real_rates_is_the_papers_method():
    """Fixed request rates (no capacity probe), the latency-threshold reading and the ratio
    checks; on a GPU with a local checkpoint, the A100-40GB's pool and full lengths."""
    cfg = compose("fig12_real_rates", ["device=cuda", "model=local", "model.model=/data/opt"])
    assert cfg.probe is None and cfg.executor._target_.endswith("RealExecutor")
    assert cfg.sustained_rate_from == "latency_threshold" and cfg.latency_threshold_s == 0.2
    assert list(cfg.checks) == ["ratios", "ordering"]
    assert cfg.workload.duration_s == 300.0 and cfg.workload.num_requests is None
    assert cfg.kv_budget_of == "a100-40gb" and cfg.workload.length_scale == 1.0
    assert cfg.model.model == "/data/opt" and cfg.model.device == "cuda"
    assert set(cfg.rates) == {"paged", "orca_oracle", "orca_pow2", "orca_max"}
    probe = compose("fig12_real", ["device=cuda"])
    assert probe.probe is not None and probe.sustained_rate_from == "capacity"
