"""Real-mode figures at any scale: the KV budget of another GPU, the policy filter, the time
budget, rates from a capacity probe, and Fig. 2 / 12 / 13 on the real engine (tiny model, CPU)
with the outputs that say what ran where."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from paged_llm.metrics.serving import IterationRecord, RequestRecord
from paged_llm.models.presets import preset_config
from paged_llm.sim.kv_budget import kv_budget
from paged_llm.sim.settings import ServingSettings
from paper_repro import real_figures
from paper_repro.common import compose
from paper_repro.real_mode import num_runs, prepare_config, saturated_throughput
from paper_repro.sim_beside_real import compare

ARTIFACT = ServingSettings(block_size=16, max_num_batched_tokens=2560, max_num_seqs=256)


def plain(name: str, overrides: list[str] | None = None) -> dict:
    return OmegaConf.to_container(compose(name, overrides or []), resolve=True)


def test_kv_budget_of_the_papers_a100_matches_table_1():
    """OPT-13B on an A100-40GB: 967 blocks, within 2% of the artifact's profiled 983 (15.7K
    slots, Table 1); an 80 GB card holds more than twice that; OPT-13B does not fit a 3090,
    OPT-6.7B does."""
    opt13 = preset_config("opt-13b")
    a100 = kv_budget("a100-40gb", opt13, ARTIFACT, "opt-13b")
    assert a100.num_blocks == 967 and abs(a100.num_slots / (983 * 16) - 1) < 0.02
    assert a100.kv_bytes_per_token == 2 * 5120 * 40 * 2  # 800 KiB: K and V, 40 layers, fp16
    assert kv_budget("a100-80gb", opt13, ARTIFACT, "opt-13b").num_blocks > 2 * a100.num_blocks
    with pytest.raises(ValueError, match="leaves no room"):
        kv_budget("rtx3090", opt13, ARTIFACT, "opt-13b")
    rtx = kv_budget("rtx3090", preset_config("opt-6.7b"), ARTIFACT, "opt-6.7b")
    room = 24 * 2**30 * 0.9 - rtx.weight_bytes - rtx.activation_bytes  # the memory plan by hand
    assert rtx.num_blocks == int(room // (16 * 2 * 4096 * 32 * 2)) == 1151
    # a field of the GPU preset can be overridden: half the memory, fewer blocks
    half = kv_budget({"name": "a100-40gb", "memory_bytes": 36 * 2**30}, opt13, ARTIFACT, "x")
    assert half.num_blocks < a100.num_blocks


@pytest.mark.parametrize("fig", ["fig2_real", "fig12_real", "fig13_real"])
def test_gpu_configs_take_the_artifacts_settings_and_the_a100_pool(fig):
    """``device=cuda model=opt-13b``: fp16 on CUDA, the artifact's engine settings, full lengths,
    and the pool sized to the A100-40GB's; the CPU default keeps the CPU scale."""
    cfg = prepare_config(plain(fig, ["device=cuda", "model=opt-13b"]))
    model = cfg["executor"]["model"]
    assert (model["model"], model["device"], model["dtype"]) == ("opt-13b", "cuda", "float16")
    assert cfg["engine"]["max_num_batched_tokens"] == 2560 and cfg["engine"]["block_size"] == 16
    assert cfg["policies"]["paged"]["max_num_seqs"] == 2048
    assert cfg["policies"]["orca_oracle"]["max_num_seqs"] == 256
    assert cfg["engine"]["num_gpu_blocks"] == 967 and cfg["kv_budget"]["gpu"] == "A100-40GB"
    assert cfg["workload"]["length_scale"] == 1.0
    cpu = prepare_config(plain(fig))
    assert cpu["executor"]["model"]["device"] == "cpu" and cpu["engine"]["num_gpu_blocks"] == 64
    assert "kv_budget" not in cpu


def test_policy_filter_and_time_budget():
    cfg = prepare_config(plain("fig12_real", ["run_policies=[paged,orca_oracle]", "budget_s=90"]))
    assert set(cfg["policies"]) == set(cfg["rates"]) == {"paged", "orca_oracle"}
    assert num_runs(cfg) == 2 * 3 + 2  # 3 fractions each, one probe each
    assert num_runs({**cfg, "seeds": [0, 1]}) == 2 * 2 * 3 + 2  # probes run once, not per seed
    share = 90 / 8
    assert cfg["stop_time_s"] == pytest.approx(0.9 * share)
    assert cfg["workload"]["duration_s"] == cfg["stop_time_s"] and cfg["probe"]["max_s"]
    # Fig. 13: 2 workloads x 1 policy + a probe per workload = 4 runs of 10 s
    fig13 = prepare_config(plain("fig13_real", ["run_policies=[paged]", "budget_s=40"]))
    assert fig13["windows"] == {"sharegpt": [3.0, 9.0], "alpaca": [3.0, 9.0]}
    assert all(w["duration_s"] == 9.0 for w in fig13["workloads"].values())
    with pytest.raises(ValueError, match=r"run_policies \['fast'\]"):
        prepare_config(plain("fig2_real", ["run_policies=[fast]"]))


def _record(rid: str, finished: float | None) -> RequestRecord:
    return RequestRecord(rid, 4, 4, 0.0, finished_time=finished)


def test_saturated_throughput_ignores_the_drain():
    """Completions while requests still waited (3 by t = 2 s), not the whole burst's drain."""
    its = [IterationRecord(t, 0.5, 2, 2, wait, 0, 1.0, 0) for t, wait in
           [(0.0, 4), (0.5, 3), (1.0, 2), (1.5, 1), (2.0, 0), (5.0, 0)]]  # fmt: skip
    reqs = [_record(str(i), t) for i, t in enumerate([0.4, 1.2, 1.9, 3.0, 5.5])]
    trace = SimpleNamespace(iterations=its, requests=reqs, end_time=5.5, policy="paged")
    assert saturated_throughput(trace) == pytest.approx(3 / 2.0)
    trace.iterations = [IterationRecord(0.0, 0.5, 5, 5, 0, 0, 1.0, 0)]  # the burst fit at once
    assert saturated_throughput(trace) == pytest.approx(5 / 5.5)


def test_real_figures_in_one_budget(tmp_path):
    """Fig. 2, 12 and 13 on the real engine (tiny model, CPU) within one budget: each output
    says real, the hardware, the probed capacities and the rates they gave; then the
    simulator's twin of each, side by side."""
    over = ["run_policies=[paged,orca_max]", "probe.num_requests=24"]
    index = json.loads(real_figures.run_all(over, tmp_path, budget_s=30).read_text())
    assert set(index["figures"]) == {"fig2", "fig12", "fig13"}
    assert sum(f["budget_s"] for f in index["figures"].values()) == pytest.approx(30)
    fig2 = json.loads((tmp_path / "fig2" / "fig2.json").read_text())
    info = fig2["run_info"]
    assert info["mode"] == "real" and "CPU" in info["hardware"] and "tiny" in info["hardware"]
    cap = info["probe"]["capacity"]["sharegpt"]["paged"]
    assert cap > 0 and fig2["config"]["workload"]["request_rate"] == pytest.approx(1.7 * cap)
    assert fig2["paged"]["token_states"] > fig2["orca_max"]["token_states"]
    fig12 = json.loads((tmp_path / "fig12" / "fig12.json").read_text())
    probed = fig12["run_info"]["probe"]["capacity"]["sharegpt"]
    rates = [q["request_rate"] for q in fig12["paged"]["points"]]
    assert rates == pytest.approx([f * probed["paged"] for f in (0.25, 0.75, 1.5)])
    fig13 = json.loads((tmp_path / "fig13" / "fig13.json").read_text())
    assert fig13["sharegpt"]["paged"]["mean_batched_requests"] > 0
    assert set(fig13["run_info"]["probe"]["capacity"]) == {"sharegpt", "alpaca"}
    # the simulator's twin of each run: same pool, rates and windows, priced on an H200
    compare(tmp_path, "h200", seeds=2)
    side = json.loads((tmp_path / "sim_beside_real.json").read_text())
    rows = {r["quantity"]: r for r in side["rows"]}
    assert rows["Fig. 2 token states, paged"]["real"] == fig2["paged"]["token_states"]
    assert len(rows) == 2 + 2 + 4 and all(r["simulated_mean"] is not None for r in rows.values())
    twin = json.loads((tmp_path / "sim_h200" / "fig2" / "fig2.json").read_text())
    assert twin["run_info"]["mode"] == "simulated" and "H200" in twin["run_info"]["hardware"]
    assert all(twin["config"][k] == fig2["config"][k] for k in ("engine", "window", "policies"))
    assert twin["config"]["workload"]["request_rate"] == fig2["config"]["workload"]["request_rate"]
    assert (tmp_path / "sim_beside_real.md").read_text().count("\n") == 2 + len(rows)
