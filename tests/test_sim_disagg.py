"""The disaggregation simulator (paged_llm/sim/disagg.py): a colocated replica is exactly the
established simulator on its share of the requests, a decode instance finds every transferred
prompt block through the connector lookup and computes only the rest, and the transfer costs
what the link says."""

import dataclasses

import pytest

from paged_llm.sim.disagg import simulate
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import build_workload

EXECUTOR = SimulatedExecutor("a100-40gb", "opt-13b")
SETTINGS = ServingSettings()


def workload(rate: float, n: int = 40):
    return build_workload({"request_rate": rate, "num_requests": n, "duration_s": None})


def test_a_colocated_replica_is_the_simulator_on_its_share():
    wl = workload(3.0)
    run = simulate(wl, EXECUTOR, SETTINGS, "colocated", 1, 1)  # two replicas
    ordered = sorted(wl.requests, key=lambda r: r.arrival_time)
    share = dataclasses.replace(wl, requests=ordered[0::2])  # what replica 0 was dealt
    trace = EXECUTOR.run(share, "paged", SETTINGS)
    got = dict(zip(run.request_ids, zip(run.ttft_s, run.e2el_s)))
    for rec in trace.requests:
        ttft, e2el = got[rec.request_id]
        assert ttft == pytest.approx(rec.first_token_time - rec.arrival_time, abs=1e-9)
        assert e2el == pytest.approx(rec.finished_time - rec.arrival_time, abs=1e-9)


def test_decode_instances_load_the_prompts_and_pay_for_the_link():
    wl = workload(0.2, 12)  # far apart: no queueing anywhere
    colocated = simulate(wl, EXECUTOR, SETTINGS, "colocated", 1, 1)
    split = simulate(wl, EXECUTOR, SETTINGS, "disaggregated", 1, 1, link_gb_per_s=10.0)
    bs = SETTINGS.block_size
    assert split.loaded_blocks == sum((r.input_len - 1) // bs for r in wl.requests)
    kv = EXECUTOR.model.kv_bytes_per_token
    by_id = {r.request_id: r for r in wl.requests}
    want = sorted(by_id[i].input_len * kv / 10e9 + 1e-3 for i in split.request_ids)
    assert sorted(split.transfer_s) == pytest.approx(want)
    # the first token now waits for the prefill, the transfer and a decode step
    assert all(b > a for a, b in zip(colocated.ttft_s, split.ttft_s))
    assert set(split.busy) == {"prefill0", "decode0"} and split.preemptions == 0
    assert split.slo_attainment(10.0, 1.0) == 1.0 and split.slo_attainment(0.0, 1.0) == 0.0


def test_bad_layouts_are_refused():
    wl = workload(1.0, 4)
    with pytest.raises(ValueError, match="unknown layout"):
        simulate(wl, EXECUTOR, SETTINGS, "pipelined")
    with pytest.raises(ValueError, match="at least one prefill"):
        simulate(wl, EXECUTOR, SETTINGS, "disaggregated", 0, 2)
    beams = build_workload({"request_rate": 1.0, "num_requests": 4, "duration_s": None,
                            "beam_width": 2})  # fmt: skip
    with pytest.raises(ValueError, match="single-sequence"):
        simulate(beams, EXECUTOR, SETTINGS)


def test_the_sweep_reports_goodput_per_gpu(tmp_path):
    from experiments.disagg_sim import parse_layout, write
    from paper_repro.common import compose

    cfg = compose("disagg_sim", ["duration=20", "rates=[1,2]",
                                 "layouts=[colocated:2,disaggregated:1:1]"])  # fmt: skip
    doc = write(cfg, tmp_path)
    assert doc["mode"] == "simulated" and doc["hardware"].endswith("A100-40GB per instance")
    assert set(doc["goodput"]) == {"colocated:2", "disaggregated:1:1"}
    assert all(0 <= g["goodput_per_gpu"] <= 1.0 for g in doc["goodput"].values())
    assert len(doc["runs"]) == 4
    with pytest.raises(ValueError, match="bad layout"):
        parse_layout("colocated:1")
