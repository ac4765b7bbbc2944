"""Issue 49's acceptance at CI size: a 2 x 2 figure sweep (Fig. 2, seeds x request rate, 20 s
traces) through submitit's local launcher merges into one table with a mean and a 95% interval
per configuration, and its offline W&B runs land in the sweep directory, grouped by sweep."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paper_repro.seeds import summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fig2_sweep(tmp_path_factory):
    """``python -m paper_repro.fig2 -m`` over seeds [0], [1] and rates 2, 4, four submitit jobs."""
    sweep_dir = tmp_path_factory.mktemp("fig2") / "seeds-x-rate"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_DIR", None)
    cmd = [sys.executable, "-m", "paper_repro.fig2", "-m", "hydra/launcher=submitit_local",
           "seeds=[0],[1]", "workload.request_rate=2,4", "workload.duration_s=20",
           "window=[5,20]", "progress=false", "logger=wandb",
           f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return sweep_dir


def test_one_merged_row_per_configuration_with_mean_and_interval(fig2_sweep):
    jobs = list(csv.DictReader((fig2_sweep / "sweep.csv").read_text().splitlines()))
    merged = list(csv.DictReader((fig2_sweep / "sweep_mean.csv").read_text().splitlines()))
    assert len(jobs) == 4 and [r["workload.request_rate"] for r in merged] == ["2", "4"]
    for row in merged:
        members = [j for j in jobs if j["workload.request_rate"] == row["workload.request_rate"]]
        assert {j["seeds"] for j in members} == {"[0]", "[1]"} and row["samples"] == "2"
        values = []
        for j in members:  # each job's own fig2.json, not the table's rounding
            data = json.loads((fig2_sweep / j["job"] / "fig2.json").read_text())
            values.append(data["paged"]["token_states"])
        s = summarize(values)
        assert float(row["paged_token_states"]) == pytest.approx(s["mean"])
        assert float(row["paged_token_states_ci95_low"]) == pytest.approx(s["ci95_low"])
        assert float(row["paged_token_states_ci95_high"]) == pytest.approx(s["ci95_high"])
        assert row["mode"] == "simulated" and "A100-40GB" in row["hardware"]
    for j in jobs:  # where each job ran: submitit started all four at once on this host
        assert j["host"] and j["jobs_on_host"] and int(j["jobs_on_host"]) >= 1
    md = (fig2_sweep / "sweep.md").read_text()
    assert "## Mean and 95% interval per configuration (4 jobs in 2" in md
    assert (fig2_sweep / "sweep.png").stat().st_size > 1000


def test_wandb_offline_runs_in_the_sweep_directory_grouped_by_sweep(fig2_sweep):
    runs = sorted((fig2_sweep / "wandb").glob("offline-run-*"))
    records = [next(r.glob("run-*.wandb")).read_bytes() for r in runs]
    group = f"fig2-{fig2_sweep.name}".encode()
    assert len(runs) == 5 and all(group in data for data in records)  # 4 jobs + the summary
    named = [d for d in records if b"seeds=[1]" in d and b"workload.request_rate=4" in d]
    assert named  # a job's run is named by its overrides
    summary = [r for r in runs if (r / "files" / "sweep_mean.csv").is_file()]
    assert len(summary) == 1


def test_joblib_jobs_record_their_shared_host(tmp_path):
    """Two jobs at once through joblib (hydra/launcher=parallel): each knows it shares the host
    with the other, gets at most its share of the cores, and warns in its log."""
    cmd = [sys.executable, "-m", "paper_repro.fig2", "-m", "hydra/launcher=parallel",
           "seeds=[0],[1]", "workload.duration_s=10", "window=[2,10]", "progress=false",
           f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for job in ("0", "1"):
        record = json.loads((tmp_path / job / "sweep_job.json").read_text())
        assert record["jobs_at_once"] == 2
        assert 1 <= record["threads"] <= max(1, record["cores"] // 2)  # its share, or less
        assert "2 jobs run at once on" in (tmp_path / job / "fig2.log").read_text()
    merged = list(csv.DictReader((tmp_path / "sweep_mean.csv").read_text().splitlines()))
    assert len(merged) == 1 and merged[0]["samples"] == "2"  # the seeds, merged
