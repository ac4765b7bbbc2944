"""The simulator's exact fast-forward of pure-decode windows (paged_llm/sim/fast_forward.py):
the same workload run with and without it gives identical records (every request's times and
tokens, every iteration, the end time) and leaves the KV manager's blocks in the same state,
across KV policies, preemption modes, chunked prefill, prefix caching, parallel sampling and
beam search (where it falls back), memory sampling, a stop time and overload. And on a
decode-heavy workload windows do happen."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.core.kv.paged import PagedKVCacheManager
from paged_llm.sim import executor as sim_executor
from paged_llm.sim.executor import RunCheck, SimulatedExecutor
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import TimedRequest, Workload

POLICIES = ("paged", "orca_oracle", "orca_pow2", "orca_max", "static")
LEN = 512  # max_model_len: the random requests are at most 300 + 200 tokens


def examples(n: int):
    """Hypothesis settings: ``n`` workloads, no deadline (a run takes a while)."""
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


def workload(rng: random.Random, num: int, rate: float, **shape: int) -> Workload:
    """``num`` requests of random lengths arriving as a Poisson process at ``rate``."""
    t, reqs = 0.0, []
    for i in range(num):
        t += rng.expovariate(rate)
        reqs.append(TimedRequest(f"r{i}", rng.randint(1, 300), rng.randint(1, 200), t, **shape))
    return Workload(reqs, "synthetic:test", True, rate, meta={"seed": rng.randint(0, 99)})


def kv_state(kv) -> tuple:
    """The KV manager's block accounting: tables, and the free list in its order."""
    tables = {rid: list(t) for rid, t in kv.block_tables.items()}
    if isinstance(kv, PagedKVCacheManager):
        cpu = {rid: list(t) for rid, t in kv.cpu_block_tables.items()}
        return tables, list(kv.pool._free), list(kv.pool.ref_counts), cpu
    return tables, [sorted(s) for s in kv.buddy._free], dict(kv.buddy._allocated)


def run_both(monkeypatch, wl, policy, s, **kw):
    """The run without and with fast-forward, and their KV managers' states afterwards (no
    memory sampling unless asked: it would look at every step)."""
    kw.setdefault("memory_every", 0)
    built = []

    def build(*a, **k):
        built.append(original(*a, **k))
        return built[-1]

    original = sim_executor.build_scheduler
    monkeypatch.setattr(sim_executor, "build_scheduler", build)
    traces = [SimulatedExecutor(fast_forward=ff).run(wl, policy, s, **kw) for ff in (False, True)]
    return traces, [kv_state(b.kv) for b in built], built


def assert_identical(monkeypatch, wl, policy, s, **kw):
    """Identical records, end time, preemptions and block accounting; the fast run's trace."""
    (slow, fast), (kv_slow, kv_fast), (a, b) = run_both(monkeypatch, wl, policy, s, **kw)
    assert slow.extra["fast_forward"]["iterations"] == 0
    assert fast.requests == slow.requests
    assert fast.iterations == slow.iterations
    assert fast.end_time == slow.end_time
    assert kv_fast == kv_slow
    assert b.num_preemptions_total == a.num_preemptions_total

    return fast


@pytest.mark.parametrize("policy", POLICIES)
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10**6), rate=st.sampled_from([0.5, 4.0, 40.0]),
       blocks=st.sampled_from([64, 256, 2048]))  # fmt: skip
def test_policies_give_identical_runs(monkeypatch, policy, seed, rate, blocks):
    """Light load, queues and preemptions (a 64-block pool), under every policy."""
    wl = workload(random.Random(seed), 12, rate)
    assert_identical(
        monkeypatch, wl, policy, ServingSettings(max_model_len=LEN, num_gpu_blocks=blocks)
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"preemption_mode": "swap", "swap_space_gib": 0.05},
        {"preemption_mode": "swap"},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 64},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 4, "max_num_seqs": 3},
        {"max_num_seqs": 2},
        {"block_size": 8, "num_gpu_blocks": 96},
        {"scheduling_policy": "priority"},
    ],
    ids=["swap-small", "swap", "chunked", "chunked-tiny-budget", "few-seqs", "bs8", "priority"],
)
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10**6), rate=st.sampled_from([1.0, 40.0]))
def test_engine_settings_give_identical_runs(monkeypatch, overrides, seed, rate):
    """Swap and recompute preemption, chunked prefill, tight limits, priority order."""
    wl = workload(random.Random(seed), 12, rate)
    s = ServingSettings(max_model_len=LEN, num_gpu_blocks=48).with_overrides(**overrides)
    assert_identical(monkeypatch, wl, "paged", s)


@pytest.mark.parametrize(
    "shape, policy, overrides",
    [
        ({"n": 3}, "paged", {}),
        ({"n": 2}, "orca_oracle", {}),
        ({"beam_width": 3}, "paged", {}),
        ({"beam_width": 2}, "orca_max", {}),
        ({"prefix_len": 64}, "paged", {"enable_prefix_caching": True}),
    ],
    ids=["samples-paged", "samples-orca", "beams-paged", "beams-orca", "prefix-caching"],
)
@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10**6))
def test_sharing_and_groups_give_identical_runs(monkeypatch, shape, policy, overrides, seed):
    """Parallel samples (forked: copy-on-write first), beams and prefix caching, where the
    fast-forward must fall back or wait until the blocks it writes are its own."""
    wl = workload(random.Random(seed), 8, 2.0, **shape)
    s = ServingSettings(num_gpu_blocks=400, max_model_len=1024, **overrides)
    assert_identical(monkeypatch, wl, policy, s)


@pytest.mark.parametrize("policy", ["paged", "orca_pow2"])
def test_stop_time_and_memory_sampling_give_identical_runs(monkeypatch, policy):
    """A stop time inside a window, and the memory sampler's window and stride."""
    wl = workload(random.Random(7), 30, 3.0)
    s = ServingSettings(max_model_len=LEN, num_gpu_blocks=100)
    for kw in (
        {"stop_time": 4.321, "memory_every": 0},
        {"memory_window": (2.0, 5.0), "memory_every": 3},
        {"memory_every": 1},  # every step sampled: no window at all
    ):
        fast = assert_identical(monkeypatch, wl, policy, s, **kw)
        assert (fast.extra["fast_forward"]["iterations"] == 0) == (kw == {"memory_every": 1})


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_finishing_in_one_step_free_in_order(monkeypatch, policy):
    """A burst of equal outputs finishes inside one window step; the blocks it frees go
    back in the scheduler's order, which the next burst's tables show."""
    rng = random.Random(5)
    reqs = [TimedRequest(f"r{i}", rng.randint(20, 200), 120, 20.0 * (i // 6)) for i in range(12)]
    wl = Workload(reqs, "synthetic:test", True, 0.3)
    s = ServingSettings(max_model_len=LEN, num_gpu_blocks=128)
    fast = assert_identical(monkeypatch, wl, policy, s, stop_time=21.0)
    assert fast.extra["fast_forward"]["windows"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_windows_happen_on_a_decode_heavy_workload(monkeypatch, policy):
    """Long outputs, few arrivals: most iterations are advanced by the fast-forward."""
    rng = random.Random(3)
    reqs = [TimedRequest(f"r{i}", rng.randint(10, 100), 400, 0.5 * i) for i in range(8)]
    wl = Workload(reqs, "synthetic:test", True, 2.0)
    fast = assert_identical(monkeypatch, wl, policy, ServingSettings(num_gpu_blocks=2048))
    counted = fast.extra["fast_forward"]
    assert counted["windows"] > 0
    assert counted["iterations"] > len(fast.iterations) // 2


@pytest.mark.parametrize("policy", ["paged", "orca_max"])
def test_windows_go_on_while_requests_wait_for_room(monkeypatch, policy):
    """A small pool: arrivals wait for blocks, and the steps in which none can start are
    advanced too (the admission that finally succeeds is the scheduler's)."""
    rng = random.Random(9)
    reqs = [TimedRequest(f"r{i}", rng.randint(100, 300), 200, 0.2 * i) for i in range(16)]
    wl = Workload(reqs, "synthetic:test", True, 5.0)
    fast = assert_identical(monkeypatch, wl, policy, ServingSettings(max_model_len=LEN,
                            num_gpu_blocks=96))  # fmt: skip
    assert fast.extra["fast_forward"]["waiting_iterations"] > 0


@pytest.mark.parametrize("policy", ["paged", "orca_oracle"])
def test_a_check_stops_the_run_where_stop_time_would(monkeypatch, policy):
    """RunCheck: a look that says stop ends the run in the state run(stop_time=t) ends in; a
    look that does not changes nothing."""
    wl = workload(random.Random(11), 40, 6.0)
    s = ServingSettings(max_model_len=LEN, num_gpu_blocks=100)
    ex = SimulatedExecutor()
    seen = []

    def stop(trace):
        seen.append(trace.end_time)
        return len(seen) == 2

    stopped = ex.run(wl, policy, s, memory_every=0, check=RunCheck([1.0, 2.5, 4.0], stop))
    assert seen[0] >= 1.0 and seen[1] >= 2.5 and stopped.end_time == seen[1]
    plain = ex.run(wl, policy, s, memory_every=0, stop_time=2.5)
    assert (stopped.requests, stopped.iterations) == (plain.requests, plain.iterations)
    looked = ex.run(wl, policy, s, memory_every=0, check=RunCheck([1.0, 3.0], lambda t: False))
    whole = ex.run(wl, policy, s, memory_every=0)
    assert (looked.requests, looked.iterations, looked.end_time) == (
        whole.requests, whole.iterations, whole.end_time,
    )  # fmt: skip
