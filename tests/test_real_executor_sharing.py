"""Memory sharing in real runs (paged_llm/sim/real_executor.py): parallel sampling, beam search
and shared prefixes through the real LLMEngine on the built-in tiny model (CPU), recorded like
simulated runs, and Fig. 14's real configuration at smoke size."""

import json

import pytest

from paged_llm.metrics.serving import serving_metrics
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.real_executor import RealExecutor
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import TimedRequest, Workload
from paper_repro import fig14, fig16
from paper_repro.common import compose

SETTINGS = ServingSettings(num_gpu_blocks=64, max_model_len=128, max_num_batched_tokens=256)


def workload(*requests: TimedRequest) -> Workload:
    return Workload(list(requests), "test", True, 100.0)


def run(wl: Workload, policy: str = "paged", settings: ServingSettings = SETTINGS):
    return RealExecutor(warmup_requests=1).run(wl, policy, settings)


def check_finished(trace, width: int) -> None:
    """Every request finished; each of its ``width`` sequences has its full output length."""
    lens = trace.extra["output_tokens_per_sequence"]
    for r in trace.requests:
        assert r.finished and len(r.token_times) == r.output_len, r
        assert lens[r.request_id] == [r.output_len] * width, (r.request_id, lens[r.request_id])
    assert all(it.memory is not None for it in trace.iterations)  # Fig. 2 breakdown kept


def peak_blocks(trace) -> float:
    return max(it.kv_usage for it in trace.iterations) * trace.num_kv_blocks


def test_parallel_sampling_forks_and_shares_prompt_blocks():
    """n = 3 samples of a 40-token prompt share its two full blocks: fewer blocks at the peak
    than the same 9 sequences as independent requests, and a positive saving in the block
    tables. A reservation policy runs the samples as independent sequences."""
    reqs = [TimedRequest(f"r{i}", 40, 12, 0.0, n=3) for i in range(3)]
    shared = run(workload(*reqs))
    check_finished(shared, 3)
    assert shared.extra["sharing"]["saving"] > 0.1
    alone = [TimedRequest(f"r{i}-{j}", 40, 12, 0.0) for i in range(3) for j in range(3)]
    independent = run(workload(*alone))
    assert peak_blocks(shared) < peak_blocks(independent)
    orca = run(workload(*reqs), "orca_oracle")
    check_finished(orca, 3)
    assert "sharing" not in orca.extra


def test_beam_search_forks_beams_and_shares_their_history():
    """Real beam search of width 3: every beam has the full output length, each request emits
    one token per beam-search step, and beams share most of their blocks (parents' histories)."""
    reqs = [TimedRequest(f"r{i}", 20, 10, 0.01 * i, beam_width=3) for i in range(3)]
    trace = run(workload(*reqs))
    check_finished(trace, 3)
    assert trace.extra["sharing"]["saving"] > 0.3
    # Orca cannot share: width-3 beams run as 3 independent sequences (as in simulated runs)
    orca = run(workload(*reqs), "orca_oracle")
    check_finished(orca, 3)
    assert peak_blocks(trace) < peak_blocks(orca)


def test_beam_groups_survive_swapping_out():
    """A pool too small for every beam group (but for each: 4 x 4 blocks, see
    Scheduler.check_group_fits): groups are swapped out and back, and finish."""
    reqs = [TimedRequest(f"r{i}", 30, 20, 0.0, beam_width=4) for i in range(4)]
    s = SETTINGS.with_overrides(num_gpu_blocks=16, preemption_mode="swap", swap_space_gib=0.01)
    trace = run(workload(*reqs), settings=s)
    check_finished(trace, 4)
    assert serving_metrics(trace)["num_preemptions"] > 0


def test_shared_prefix_hits_the_prefix_cache_exactly_as_simulated():
    """32-token shared prefix + 24 own tokens: the cache finds the 2 prefix blocks of every
    request after the first and nothing else, the same hit rate as the simulated executor."""
    reqs = [TimedRequest(f"r{i}", 56, 6, 0.05 * i, prefix_len=32) for i in range(6)]
    s = SETTINGS.with_overrides(enable_prefix_caching=True)
    trace = run(workload(*reqs), settings=s)
    check_finished(trace, 1)
    assert trace.extra["prefix_cache_hit_rate"] == pytest.approx(5 * 2 / (6 * 3))
    sim = SimulatedExecutor().run(workload(*reqs), "paged", s)
    assert trace.extra["prefix_cache_hit_rate"] == sim.extra["prefix_cache_hit_rate"]


def test_mixed_beam_and_sampled_workload_is_refused():
    wl = workload(TimedRequest("a", 8, 4, 0.0, n=2), TimedRequest("b", 8, 4, 0.0, beam_width=2))
    with pytest.raises(NotImplementedError, match="separate runs"):
        run(wl)


def test_fig14_real_smoke(tmp_path):
    """fig14_real at smoke size: paged vs Orca (Oracle), n = 2 and width 2, 3 requests."""
    drop = ["basic", "parallel_4", "parallel_6", "beam_4", "beam_6"]
    over = [f"~settings.{s}" for s in drop] + ["~policies.orca_pow2", "~policies.orca_max"]
    over += ["workload.num_requests=3", "workload.max_total_len=48"]
    fig14.run(compose("fig14_real", over), tmp_path)
    d = json.loads((tmp_path / "fig14.json").read_text())
    assert {p.name for p in tmp_path.iterdir()} >= {"fig14.json", "fig14.csv", "fig14.png"}
    assert d["run_info"]["mode"] == "real" and d["run_info"]["hardware"].startswith("real tiny")
    assert d["sustained_rate_from"] == "capacity_cpu_time"
    for s in ("parallel_2", "beam_2"):
        paged, orca = d[s]["paged"]["points"][0], d[s]["orca_oracle"]["points"][0]
        assert paged["completed"] == orca["completed"] == 3
        assert paged["sharing_saving"] > 0 and orca["sharing_saving"] is None
        assert d[s]["paged"]["max_sustained_rate"] > 0


def test_fig16_real_smoke(tmp_path):
    """fig16_real at smoke size: real prefix caching behind both prefixes, 6 requests."""
    over = ["workload.num_requests=6", "rates.one_shot={paged:[200],orca_oracle:[200]}",
            "rates.five_shot={paged:[150],orca_oracle:[150]}"]  # fmt: skip
    fig16.run(compose("fig16_real", over), tmp_path)
    d = json.loads((tmp_path / "fig16.json").read_text())
    assert d["run_info"]["mode"] == "real" and d["run_info"]["hardware"].startswith("real tiny")
    for s in ("one_shot", "five_shot"):
        paged, orca = d[s]["paged"]["points"][-1], d[s]["orca_oracle"]["points"][-1]
        assert paged["completed"] == orca["completed"] == 6
        assert paged["prefix_cache_hit_rate"] > 0.5  # all but the first request's prefix blocks
        assert d[s]["paged"]["max_sustained_rate"] > 0
