"""Hydra-native ablations (issue 38): the shared engine groups, a real -m sweep of the throughput
benchmark merged by the sweep callback, one offline W&B run per job in the sweep's group, and
bad overrides refused before any work."""

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from paged_llm.config import engine_config_from_dict
from paged_llm.metrics import sweep_table
from paper_repro.common import compose

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "baselines=[]", "num_requests=3", "workload.max_total=32",
        "warmup_requests=1", "num_threads=1"]  # fmt: skip


def _throughput(tmp_path, *args, check=True):
    """``python -m experiments.throughput ARGS`` in a subprocess with offline W&B under tmp."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"),
           "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}  # fmt: skip
    (tmp_path / "wb").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.throughput", *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real 2 x 2 multirun (quant x speculative) of the throughput benchmark, logged to W&B."""
    tmp = tmp_path_factory.mktemp("sweep")
    sweep_dir = tmp / "ablation-2x2"
    _throughput(tmp, "-m", "quant=none,int8", "speculative=none,ngram", *TINY, "logger=wandb",
                f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    return tmp, sweep_dir


def test_sweep_merges_every_job_with_its_overrides(sweep):
    _, sweep_dir = sweep
    rows = list(csv.DictReader((sweep_dir / "sweep.csv").read_text().splitlines()))
    got = {(r["quant"], r["speculative"]) for r in rows}
    assert got == {("none", "none"), ("none", "ngram"), ("int8", "none"), ("int8", "ngram")}
    for r in rows:
        job = json.loads((sweep_dir / r["job"] / "throughput.json").read_text())
        assert float(r["output_tokens_per_s"]) == job["systems"]["paged_llm"]["output_tokens_per_s"]
        assert r["mode"] == "real" and r["device"] == "cpu" and r["cpu"]  # real, and where
        spec = job["config"]["engine"]["speculative_config"]
        assert (spec or {}).get("method", "none") == r["speculative"]  # the job ran its override
    md, merged = (sweep_dir / "sweep.md").read_text().split("\n## Mean and 95% interval")
    assert "varying quant, speculative" in md and "real" in md
    assert sum(line.startswith("| ") for line in md.splitlines()) == 1 + 4  # header + jobs
    # no seed swept: each job is its own configuration, one sample, no interval
    assert sum(line.startswith("| ") for line in merged.splitlines()) == 1 + 4
    means = list(csv.DictReader((sweep_dir / "sweep_mean.csv").read_text().splitlines()))
    assert [(r["jobs"], r["samples"], r["output_tokens_per_s_ci95_low"]) for r in means] == [
        (str(i), "1", "") for i in range(4)
    ]
    assert {r["host"] for r in rows} == {socket.gethostname()}
    assert {r["jobs_on_host"] for r in rows} == {"1"}  # the basic launcher: one at a time
    assert "| 3 | int8 | ngram | real |" in md
    assert (sweep_dir / "sweep.png").stat().st_size > 1000


def test_wandb_offline_one_run_per_job_in_the_sweeps_group(sweep):
    tmp, sweep_dir = sweep
    assert not (tmp / "wb" / "wandb").exists()  # the sweep directory, not $WANDB_DIR
    runs = sorted((sweep_dir / "wandb").glob("offline-run-*"))
    jobs = [r for r in runs if (r / "files" / "throughput.json").is_file()]
    summary = [r for r in runs if (r / "files" / "sweep.csv").is_file()]
    assert len(jobs) == 4 and len(summary) == 1
    for run in runs:  # the group (experiment and sweep directory) is in every run's record
        group = b"throughput-" + sweep_dir.name.encode()
        assert group in next(run.glob("run-*.wandb")).read_bytes()
    for run in jobs:  # each job's run is named by its overrides
        assert b"quant=" in next(run.glob("run-*.wandb")).read_bytes()
    for run in jobs:  # config and metrics
        data = next(run.glob("run-*.wandb")).read_bytes()
        assert b"paged_llm/output_tokens_per_s" in data and b"speculative_config" in data
    table = next((summary[0] / "files" / "media" / "table").glob("sweep_*.table.json"))
    assert len(json.loads(table.read_text())["data"]) == 4


def test_unknown_group_option_stops_the_sweep_before_any_job(tmp_path):
    out = _throughput(tmp_path, "-m", "quant=none,int3", *TINY,
                      f"hydra.sweep.dir={tmp_path / 's'}", check=False)  # fmt: skip
    assert out.returncode != 0
    assert "sweep stopped before any job ran; [quant=int3" in out.stderr
    assert "Could not find 'quant/int3'" in out.stderr and "int4_awq" in out.stderr  # the options
    assert not (tmp_path / "s" / "0").exists()  # job 0 (quant=none) never started


def test_quant_method_the_model_cannot_take_stops_the_sweep(tmp_path):
    narrow = ["model.arch.hidden_size=64", "model.arch.intermediate_size=128",
              "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=4"]  # fmt: skip
    out = _throughput(tmp_path, "-m", "quant=int8,int4_rtn", *narrow, "baselines=[]",
                      f"hydra.sweep.dir={tmp_path / 's'}", check=False)  # fmt: skip
    assert out.returncode != 0
    assert "the quant method cannot quantize this LlamaForCausalLM" in out.stderr
    assert "group_size 128 does not divide the layer's 64 input features" in out.stderr
    assert not (tmp_path / "s" / "0").exists()


def test_groups_compose_into_the_engine_config():
    over = ["quant=int8", "kv_cache_dtype=fp8_e4m3", "scheduling=priority", "speculative=ngram"]
    cfg = engine_config_from_dict(OmegaConf.to_container(compose("config", over), resolve=True))
    assert cfg.model.quantization["_target_"].endswith("Int8WeightOnly")
    assert cfg.cache.kv_cache_dtype == "fp8_e4m3" and cfg.scheduler.scheduling_policy == "priority"
    assert cfg.speculative_config["method"] == "ngram"
    plain = engine_config_from_dict(OmegaConf.to_container(compose("config"), resolve=True))
    assert plain.model.quantization is None and plain.speculative_config is None
    legacy = compose("throughput", ["engine.block_size=32", "cache.kv_cache_dtype=int8"])
    assert legacy.engine.block_size == 32 and legacy.engine.kv_cache_dtype == "int8"


def test_sweep_table_lookup_and_swept_keys(tmp_path):
    data = {"a": {"b": [1, {"c": 2}]}}
    assert sweep_table.lookup(data, "a.b.1.c") == 2 and sweep_table.lookup(data, "a.x") is None
    for job, policy in enumerate(["paged", "orca_oracle"]):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        (tmp_path / str(job) / ".hydra" / "overrides.yaml").write_text(
            f"- policy={policy}\n- seeds=2\n"
        )
        (tmp_path / str(job) / "r.json").write_text(json.dumps({"policy": policy.upper()}))
    rows, swept = sweep_table.collect_rows(tmp_path, "r.json", {"policy": "policy"})
    assert swept == ["policy"]  # varied, though a result column has the same name
    assert [r["policy"] for r in rows] == ["PAGED", "ORCA_ORACLE"] and rows[0]["seeds"] == "2"


def test_jobs_on_host_counts_the_jobs_that_overlapped_on_the_same_host():
    from paged_llm.metrics.sweep_hosts import jobs_on_host

    records = [
        {"host": "a", "start": 0.0, "end": 10.0},
        {"host": "a", "start": 5.0, "end": 15.0},  # overlaps the first and the third
        {"host": "a", "start": 12.0, "end": 20.0},
        {"host": "b", "start": 0.0, "end": 20.0},  # alone on its host
        {},  # a job run without the callback
    ]
    assert jobs_on_host(records) == [2, 3, 2, 1, None]


def test_jobs_at_once_and_threads_per_job_follow_the_launcher(monkeypatch):
    from paged_llm.metrics import sweep_hosts

    monkeypatch.setattr(sweep_hosts, "host_cores", lambda: 8)
    monkeypatch.setattr(sweep_hosts, "busy_cores", lambda: 0.0)
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    local = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    basic = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    assert sweep_hosts.jobs_at_once({"_target_": joblib, "n_jobs": 2}, 6) == 2
    assert sweep_hosts.jobs_at_once({"_target_": joblib, "n_jobs": -1}, 20) == 8  # every core
    assert sweep_hosts.jobs_at_once({"_target_": joblib, "n_jobs": -1}, 3) == 3  # only 3 jobs
    assert sweep_hosts.jobs_at_once({"_target_": local, "array_parallelism": 256}, 4) == 4
    assert sweep_hosts.jobs_at_once({"_target_": basic}, 4) == 1
    assert [sweep_hosts.threads_per_job(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert sweep_hosts.threads_per_job(4, fixed=3) == 3
    monkeypatch.setattr(sweep_hosts, "busy_cores", lambda: 6.5)  # others keep 6.5 cores busy
    assert sweep_hosts.threads_per_job(1) == 1
