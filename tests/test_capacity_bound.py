"""The capacity search's busy-time lower bound (experiments/capacity/bound.py) and the
branch-and-bound pruning that rests on it: no simulated run of the same requests is busy for
less than the bound, the bound's work counts are the simulator's own when nothing is chunked
or preempted, and a deployment that cannot beat the best so far is pruned, never the winner."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.capacity.bound import busy_time_lower_bound, ceil_sum, work_of
from experiments.capacity.deployment import Deployment
from experiments.capacity.evaluate import Prober, RateSearch, capacity
from experiments.capacity.rate_search import SLO, RatePoint
from paged_llm.workloads.arrivals import WorkloadSpec, build_workload


@settings(max_examples=300, deadline=None)
@given(lo=st.integers(-5, 300), n=st.integers(-3, 300), size=st.integers(1, 40))
def test_ceil_sum_is_the_plain_sum(lo, n, size):
    lo = max(lo, 1)
    hi = lo + n
    assert ceil_sum(lo, hi, size) == sum(-(-c // size) for c in range(lo, hi + 1))


def _deployment(rng: random.Random) -> tuple[Deployment, dict]:
    dep = Deployment(
        hardware=rng.choice(["a100-40gb", "h100"]), num_gpus=rng.choice([1, 2]),
        block_size=rng.choice([8, 16, 32]), max_num_seqs=rng.choice([4, 16, 64]),
        max_num_batched_tokens=rng.choice([256, 1024]), enable_chunked_prefill=True,
        kv_cache_dtype=rng.choice(["auto", "fp8_e4m3"]),
    )  # fmt: skip
    engine = {"max_model_len": 256, "num_gpu_blocks": rng.choice([40, 200, 4000])}
    return dep, engine


def _run(dep, engine, rate, seed, duration=4.0):
    ex = dep.executor({"name": "opt-13b"}, {})
    s = dep.settings(engine)
    w = build_workload(WorkloadSpec(path="shipped:sharegpt_opt_lengths.csv", request_rate=rate,
                                    seed=seed, duration_s=duration, length_scale=0.1,
                                    max_total_len=256))  # fmt: skip
    trace = ex.run(w, dep.policy, s, memory_every=0)
    return ex.cost_model(s.block_size), s, w, trace


@pytest.mark.parametrize("seed", range(12))
def test_no_simulated_run_is_busy_for_less_than_the_bound(seed):
    """Over random deployments, KV pools small enough to preempt, chunked prefill and tensor
    parallelism: the simulated steps' summed durations are at least the bound."""
    rng = random.Random(seed)
    dep, engine = _deployment(rng)
    cost, s, w, trace = _run(dep, engine, rate=rng.choice([5.0, 50.0, 400.0]), seed=seed)
    assert all(r.finished_time is not None for r in trace.requests)
    busy = sum(it.duration for it in trace.iterations)
    bound = busy_time_lower_bound(cost, s, s.num_gpu_blocks, w.requests)
    assert 0 < bound <= busy * (1 + 1e-9)
    new = sum(it.num_batched_tokens for it in trace.iterations)
    assert work_of(w.requests, s.block_size)["new"] <= new  # recomputation only adds


def test_the_bounds_token_count_is_the_simulators_without_preemption():
    dep = Deployment(hardware="h100", block_size=16, max_num_seqs=256,
                     max_num_batched_tokens=4096)  # fmt: skip
    cost, s, w, trace = _run(dep, {"max_model_len": 256, "num_gpu_blocks": 10_000}, 20.0, 0)
    assert not any(it.num_preemptions for it in trace.iterations)
    assert work_of(w.requests, 16)["new"] == sum(it.num_batched_tokens for it in trace.iterations)


def _prober(verdicts):
    """A prober whose verdict at a rate is given, counting its probes."""

    class Fake(Prober):
        def _probe(self, rate):
            return RatePoint(rate, verdicts(rate), 0.0, 0.0, 1.0, rate, 1)

        def busy_share(self, rate):
            return rate / 100.0  # the bound: 100 req/s fill the span

    return Fake(executor=None, policy="paged", settings=None, workload={}, seeds=[0],
                slo=SLO())  # fmt: skip


def test_capacity_prunes_what_cannot_reach_the_needed_rate():
    search = RateSearch(first_guess=None, start=10.0, rel_tol=0.05, bound_margin=0.05)
    # the bound alone: 120 req/s need 1.2 spans of busy time, nothing is simulated
    p = _prober(lambda r: r < 50)
    b = capacity(p, search, needed=120.0)
    assert (b.kind, b.upper, b.text(), p.probed) == ("pruned_bound", 120.0, "< 120 (bound)", {})
    # within the margin the bound cannot decide: one failing probe does
    b = capacity(p, search, needed=60.0)
    assert (b.kind, b.rate, list(p.probed)) == ("pruned", 0.0, [60.0])
    # a deployment that reaches it is bracketed from there up; the probe there is not rerun
    p = _prober(lambda r: r < 80)
    b = capacity(p, search, needed=60.0)
    assert b.kind == "exact" and 60.0 <= b.rate < 80 <= b.upper and b.upper / b.rate <= 1.05
    assert sorted(p.probed) == sorted(set(p.probed)) and 60.0 in p.probed
    # from a start above it, the probe that let it in still heads the points, once
    p = _prober(lambda r: r < 80)
    b = capacity(p, RateSearch(first_guess=None, start=70.0, rel_tol=0.05), needed=60.0)
    rates = [x.rate for x in b.points]
    assert rates[0] == 60.0 and len(rates) == len(set(rates)) == len(p.probed)


def test_must_beat_and_margin_refuse_bad_values():
    with pytest.raises(ValueError, match="must_beat"):
        RateSearch(must_beat=-1.0)
    with pytest.raises(ValueError, match="bound_margin"):
        RateSearch(bound_margin=-0.1)


_shape = st.builds(
    lambda seqs, new, kv, pairs: (seqs, new, kv, pairs),
    st.integers(1, 64), st.integers(1, 512), st.integers(0, 20_000), st.integers(0, 10**6),
)  # fmt: skip


def _cost_models():
    from paged_llm.sim.cost_model import RooflineCostModel
    from paged_llm.sim.hardware import get_hardware
    from paged_llm.sim.model_shapes import get_model_shape
    from paged_llm.sim.step_law import LinearCostModel, LinearStepLaw

    roof = RooflineCostModel(get_hardware("a100-40gb"), get_model_shape("opt-13b"), num_gpus=2,
                             per_seq_overhead_s=1e-5)  # fmt: skip
    concave = LinearStepLaw(2e-3, 1e-4, 1e-7, 1e-9, (4, 12), (1.4e-3, 6e-4, 3e-4))
    convex = LinearStepLaw(1e-3, 0.0, 2e-7, 0.0, (8,), (1e-4, 5e-4))
    return [roof, LinearCostModel.from_roofline(roof, concave),
            LinearCostModel.from_roofline(roof, convex)]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(_shape, min_size=1, max_size=12), which=st.integers(0, 2))
def test_least_busy_time_is_below_every_split_into_steps(parts, which):
    """For the roofline and for fitted linear laws (concave rows or not): the summed step
    times of any steps are at least the bound for their total."""
    from paged_llm.sim.cost_model import StepShape

    cost = _cost_models()[which]
    shapes = [StepShape(s, n, kv, -(-kv // 16), p) for s, n, kv, p in parts]
    total = StepShape(*(sum(getattr(x, f) for x in shapes) for f in
                        ("num_seqs", "num_new_tokens", "kv_tokens_read", "kv_blocks_read",
                         "attn_pairs")))  # fmt: skip
    busy = sum(cost.step_time(x) for x in shapes)
    assert cost.least_busy_time(total, len(shapes)) <= busy * (1 + 1e-9)
