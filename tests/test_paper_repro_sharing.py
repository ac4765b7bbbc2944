"""Memory sharing in simulated runs (parallel samples, beam search, shared prefixes, chatbot
prompts) and the Fig. 14-17 scripts at CI size: invariants of the workloads and the executor,
result files, and Fig. 15's acceptance on Alpaca (ordering, 5 percentage points)."""

import json
import math

import pytest

from paged_llm.metrics.serving import serving_metrics
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import TimedRequest, Workload, WorkloadSpec, build_workload
from paged_llm.workloads.conversations import conversation_pairs
from paged_llm.workloads.lengths import LengthPair
from paper_repro import fig14, fig15, fig16, fig17, make_table
from paper_repro.common import compose
from paper_repro.paper_numbers import FIG15, FIG15_TOLERANCE_PP

CALIBRATION = "calibration/a100-40gb_opt-13b_paper-fig1.json"
PAGED = ServingSettings(num_gpu_blocks=983, max_num_seqs=2048)


def workload(*requests: TimedRequest, **meta) -> Workload:
    return Workload(list(requests), "test", True, 1.0, meta=meta)


def run(wl, policy="paged", settings=PAGED):
    return SimulatedExecutor(calibration=CALIBRATION).run(wl, policy, settings, memory_every=0)


# ---- workloads ------------------------------------------------------------------------------
def test_default_spec_keeps_plain_requests():
    spec = dict(request_rate=5.0, duration_s=20.0, seed=1)
    plain = build_workload(WorkloadSpec(**spec))
    again = build_workload(WorkloadSpec(**spec, n=1, beam_width=1, prefix_len=0))
    assert plain.requests == again.requests
    assert all((r.n, r.beam_width, r.prefix_len) == (1, 1, 0) for r in plain.requests)
    assert "n" not in plain.meta


def test_sharing_options_shape_requests():
    base = dict(name="alpaca", synthetic="alpaca", request_rate=5.0, duration_s=20.0)
    plain = build_workload(WorkloadSpec(**base)).requests
    beams = build_workload(WorkloadSpec(**base, beam_width=4, prefix_len=80)).requests
    assert [r.input_len for r in beams] == [r.input_len + 80 for r in plain]
    assert all((r.beam_width, r.n, r.prefix_len) == (4, 1, 80) for r in beams)
    with pytest.raises(ValueError, match="not both"):
        WorkloadSpec(n=2, beam_width=2)
    with pytest.raises(ValueError, match="beam_parents"):
        WorkloadSpec(beam_parents="random")


def test_chatbot_prompts_are_histories_cut_to_the_cap():
    pairs = [LengthPair(100, 300), LengthPair(20, 50)]
    conv = conversation_pairs(pairs, 4000, seed=0, mean_earlier_turns=3.0)
    turns_mean = sum(c.input_len for c in conv) / len(conv)
    # E[prompt] = E[k] * E[in + out] + E[in] = 3 * 235 + 60
    assert turns_mean == pytest.approx(3 * 235 + 60, rel=0.05)
    assert conv == conversation_pairs(pairs, 4000, seed=0, mean_earlier_turns=3.0)
    spec = WorkloadSpec(
        request_rate=2.0, duration_s=60.0, chat_turns=3.0, max_prompt_len=1024, max_output_len=1024
    )
    reqs = build_workload(spec).requests
    assert max(r.input_len for r in reqs) == 1024 and max(r.output_len for r in reqs) <= 1024
    assert sum(r.input_len == 1024 for r in reqs) > len(reqs) / 3


# ---- the executor -------------------------------------------------------------------------------
def test_parallel_samples_share_the_prompt_blocks():
    """One request, prompt 64 tokens (4 blocks), 2 samples of 32 tokens: the samples fork after
    the prefill and re-run token 63, so they share blocks 0-2; each holds 5-6 blocks while
    decoding, so the saving is 3 / (2 x 5..6) at every decode step (less during the prefill)."""
    wl = workload(TimedRequest("a", 64, 32, 0.0, n=2))
    trace = run(wl)
    rec = trace.requests[0]
    assert rec.finished and len(rec.token_times) == 32
    saving = trace.extra["sharing"]["saving"]
    assert 0.2 < saving <= 3 / 10
    # a policy that cannot share runs the samples as two independent requests
    orca = run(wl, "orca_oracle", ServingSettings(num_gpu_blocks=983))
    assert "sharing" not in orca.extra and orca.requests[0].finished


def test_beam_search_lifecycle_and_parent_models():
    """Beams generate exactly the output length; more sharing with 'best' than 'uniform' than
    'own', and 'own' (beams share only the prompt) saves what parallel sampling saves."""
    reqs = [TimedRequest(f"r{i}", 40, 60, 0.1 * i, beam_width=4) for i in range(6)]
    savings = {}
    for parents in ("own", "uniform", "best"):
        trace = run(workload(*reqs, beam_parents=parents, seed=0))
        assert all(r.finished and len(r.token_times) == 60 for r in trace.requests)
        savings[parents] = trace.extra["sharing"]["saving"]
    assert savings["own"] < savings["uniform"] <= savings["best"]
    parallel = run(
        workload(*[TimedRequest(r.request_id, 40, 60, r.arrival_time, n=4) for r in reqs])
    )
    assert savings["own"] == pytest.approx(parallel.extra["sharing"]["saving"], abs=0.02)


def test_measured_beam_parents_replay_the_recorded_ranks():
    """beam_parents='measured' draws parents from the ranks real beam search chose (the data
    file experiments/beam_sharing.py records): a saving between the extremes, and a clear
    error for a width that was not measured."""
    from paged_llm.sim.groups import measured_parent_ranks

    table = measured_parent_ranks(4)
    assert len(table) == 4 and all(len(row) == 4 and sum(row) > 0 for row in table)
    reqs = [TimedRequest(f"r{i}", 40, 60, 0.1 * i, beam_width=4) for i in range(6)]
    saving = {p: run(workload(*reqs, beam_parents=p, seed=0)).extra["sharing"]["saving"]
              for p in ("own", "measured", "best")}  # fmt: skip
    assert saving["own"] < saving["measured"] <= saving["best"]
    with pytest.raises(ValueError, match="no measured beam-parent ranks for width 3"):
        measured_parent_ranks(3)


def test_beam_groups_survive_preemption_by_swap_and_recompute():
    """A pool too small for all beam groups at once (but for each group, 4 x 12 blocks with no
    sharing, see Scheduler.check_group_fits): groups are preempted (swapped or
    recomputed) and still finish with the right number of tokens."""
    reqs = [TimedRequest(f"r{i}", 100, 80, 0.0, beam_width=4) for i in range(8)]
    for mode in ("swap", "recompute"):
        s = ServingSettings(
            num_gpu_blocks=52, max_model_len=256, max_num_seqs=2048, preemption_mode=mode
        )
        trace = run(workload(*reqs), settings=s)
        m = serving_metrics(trace)
        assert m["completed"] == 8 and m["num_preemptions"] > 0, mode
        assert all(len(r.token_times) == 80 for r in trace.requests)


def test_orca_runs_beams_as_independent_samples():
    beams = workload(*[TimedRequest(f"r{i}", 30, 50, 0.05 * i, beam_width=6) for i in range(20)])
    samples = workload(*[TimedRequest(f"r{i}", 30, 50, 0.05 * i, n=6) for i in range(20)])
    s = ServingSettings(num_gpu_blocks=983)
    a, b = run(beams, "orca_oracle", s), run(samples, "orca_oracle", s)
    assert serving_metrics(a)["normalized_latency"] == serving_metrics(b)["normalized_latency"]


def test_prefix_caching_finds_exactly_the_shared_prefix():
    """80-token prefix + 32 own tokens: 5 of the 6 looked-up blocks hit (after the first)."""
    reqs = [TimedRequest(f"r{i}", 112, 20, 0.5 * i, prefix_len=80) for i in range(10)]
    s = ServingSettings(num_gpu_blocks=983, max_num_seqs=2048, enable_prefix_caching=True)
    trace = run(workload(*reqs), settings=s)
    assert trace.extra["prefix_cache_hit_rate"] == pytest.approx(9 * 5 / (10 * 6))
    assert trace.extra["sharing"]["saving"] >= 0
    with pytest.raises(ValueError, match="cannot cache prefixes"):
        run(workload(*reqs), "orca_oracle", ServingSettings(enable_prefix_caching=True))


# ---- the figure scripts -------------------------------------------------------------------------
def load(out, name, synthetic=True):
    d = json.loads((out / f"{name}.json").read_text())
    assert {p.name for p in out.iterdir()} >= {f"{name}.json", f"{name}.csv", f"{name}.png"}
    assert d["run_info"]["mode"] == "simulated" and "A100" in d["run_info"]["hardware"]
    # Alpaca and WMT16 lengths are synthetic (labelled so); ShareGPT alone is the shipped trace
    assert d["run_info"]["synthetic_lengths"] is synthetic
    return d


def test_fig14_quick(tmp_path):
    cfg = compose("fig14_quick", ["~settings.parallel_2", "~settings.beam_2"])
    fig14.run(cfg, tmp_path)
    d = load(tmp_path, "fig14")
    for s in ("parallel_6", "beam_6"):
        res = d[s]
        assert set(fig14.ORDER) <= set(res) and res["ratios_vs_paged"]
        assert res["paged"]["max_sustained_rate"] >= res["orca_max"]["max_sustained_rate"]
        assert all(q["sharing_saving"] > 0 for q in res["paged"]["points"])
        assert all(q["sharing_saving"] is None for q in res["orca_oracle"]["points"])
    # Orca's beam sweeps are its parallel sweeps (run once)
    assert d["beam_6"]["orca_pow2"]["points"] == d["parallel_6"]["orca_pow2"]["points"]
    assert d["beam_6"]["paged"]["points"][0]["sharing_saving"] > 0.3
    assert "Fig. 14 beam_6: paged / orca_oracle" in make_table.table(
        [("fig14", tmp_path / "fig14.json")]
    )


@pytest.fixture(scope="module")
def fig15_quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("fig15")
    fig15.run(compose("fig15_quick"), out)
    return out, load(out, "fig15")


def test_fig15_alpaca_ordering(fig15_quick):
    out, d = fig15_quick
    assert d["acceptance"]["alpaca_ordering"]["pass"], d["acceptance"]["alpaca_ordering"]
    for s in FIG15["alpaca"]:
        assert 0 < d["alpaca"][s]["saving"] < 1 and d["alpaca"][s]["paper"] == FIG15["alpaca"][s]
    assert "Fig. 15 memory saved, alpaca" in make_table.table([("fig15", out / "fig15.json")])


@pytest.mark.parametrize("setting", ["parallel_2", "parallel_4", "parallel_6", "beam_2"])
def test_fig15_alpaca_within_5pp(fig15_quick, setting):
    _, d = fig15_quick
    err = 100 * (d["alpaca"][setting]["saving"] - FIG15["alpaca"][setting])
    assert d["acceptance"][f"alpaca_{setting}"]["error_pp"] == pytest.approx(err)
    assert abs(err) <= FIG15_TOLERANCE_PP, f"{setting}: {err:+.1f} pp"


@pytest.mark.parametrize("setting", ["beam_4", "beam_6"])
def test_fig15_alpaca_wide_beams_known_gap(fig15_quick, setting):
    """The known miss (docs/paper_repro.md, "Fig. 15 beside the paper"): without logits the
    simulated beams descend from one another more than OPT-13B's did, so widths 4 and 6 save
    more than the paper, by more than the 5 pp tolerance. Pinned in both directions, so a
    simulator change that moves it (closer or further) shows here."""
    _, d = fig15_quick
    err = 100 * (d["alpaca"][setting]["saving"] - FIG15["alpaca"][setting])
    assert not d["acceptance"][f"alpaca_{setting}"]["pass"]
    assert FIG15_TOLERANCE_PP < err <= 15, f"{setting}: {err:+.1f} pp"


def test_fig16_and_fig17_quick(tmp_path):
    fig16.run(compose("fig16_quick"), tmp_path / "16")
    d = load(tmp_path / "16", "fig16")
    assert "LLaMA-13B" in d["run_info"]["hardware"]
    for s, prefix in (("one_shot", 80), ("five_shot", 341)):
        assert d[s]["workload"] == {"prefix_len": prefix}
        hits = [q["prefix_cache_hit_rate"] for q in d[s]["paged"]["points"]]
        assert all(h > 0.7 for h in hits)
        assert d[s]["paged"]["max_sustained_rate"] >= d[s]["orca_oracle"]["max_sustained_rate"]
    fig17.run(compose("fig17_quick"), tmp_path / "17")
    d = load(tmp_path / "17", "fig17", synthetic=False)
    assert d["prompts"]["share_at_prompt_cap"] > 0.3
    res = d["chatbot"]
    assert all(
        res["paged"]["max_sustained_rate"] >= res[p]["max_sustained_rate"]
        for p in ("orca_oracle", "orca_pow2", "orca_max")
    )
    assert not math.isnan(res["paged"]["points"][0]["normalized_latency"])
    table = make_table.table(
        [("fig16", tmp_path / "16" / "fig16.json"), ("fig17", tmp_path / "17" / "fig17.json")]
    )
    assert "Fig. 16 five_shot: paged / orca_oracle" in table and "Fig. 17 chatbot" in table


def test_figure_configs_compose():
    for name in ("fig14", "fig15", "fig16", "fig17"):
        cfg = compose(name)
        assert cfg.settings and cfg.executor._target_.endswith("SimulatedExecutor")


def test_multi_turn_conversations_hit_earlier_turns_and_the_cpu_tier_keeps_more():
    """Later turns find their conversation's earlier blocks; on a pool too small for every
    history, the CPU tier finds more; every run serves every turn; the real engine refuses
    conversations (it would not write the replies they replay)."""
    wl = build_workload(WorkloadSpec(turns=4, think_time_s=20.0, request_rate=0.3,
                                     duration_s=120.0, seed=1))  # fmt: skip
    small = dict(num_gpu_blocks=300, max_num_seqs=256, enable_prefix_caching=True)
    rates = {}
    for gib in (0.0, 8.0):
        trace = run(wl, settings=ServingSettings(**small, kv_offloading_size=gib))
        assert all(r.finished for r in trace.requests)
        rates[gib] = trace.extra["prefix_cache_hit_rate"]
    assert 0 < rates[0.0] < rates[8.0]
    assert trace.extra["kv_offload"]["loaded"] > 0
    from paged_llm.sim.real_executor import RealExecutor

    with pytest.raises(ValueError, match="simulator only"):
        RealExecutor().run(wl, "paged", ServingSettings(**small))
