"""The paged policy's features attach when the manager and the scheduler are built
(core/kv/paged.py's hooks, core/preemption.py's strategies; the scheduler's LoRA limit and
draft slots): a step enters a feature's module exactly when that feature is on (the prefix
cache's block index included, and async scheduling's placeholders), and the module of
preemption only when a request is preempted. This is what keeps the reading path of a default
step short (docs/architecture.md)."""

from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from experiments.reading_path import files_run_by
from paged_llm.core.kv.paged import PagedKVCacheManager
from paged_llm.core.request import PLACEHOLDER_TOKEN, Request
from paged_llm.core.scheduler import Scheduler, SchedulerLimits
from paged_llm.sampling_params import SamplingParams

BS, MAX_LEN = 4, 32


@settings(max_examples=40, deadline=None)
@given(
    prefix=st.booleans(),
    window=st.none() | st.integers(2, 9),
    swap=st.booleans(),
    track=st.booleans(),
    requests=st.lists(
        st.tuples(st.lists(st.integers(1, 3), min_size=4, max_size=12), st.integers(1, 8)),
        min_size=1,
        max_size=6,
    ),
)
def test_a_step_enters_a_features_module_exactly_when_it_is_on(
    prefix, window, swap, track, requests
):
    kv = PagedKVCacheManager(8, BS, MAX_LEN, num_cpu_blocks=8 if swap else 0,
                             enable_prefix_caching=prefix, sliding_window=window)  # fmt: skip
    mode = "swap" if swap else "recompute"
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=MAX_LEN, preemption_mode=mode)
    sched = Scheduler(kv, limits, track_memory=track)
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params, max_model_len=MAX_LEN))

    def run() -> None:
        for step in range(200):
            if not sched.has_unfinished():
                return
            out = sched.schedule(float(step))
            sampled = {s.request.request_id: [1] for s in out.scheduled if s.samples}
            sched.update_from_output(out, sampled, float(step))
        raise AssertionError("the requests did not finish in 200 steps")

    seen = {p.name for p in files_run_by(run)}
    event(f"preempted: {sched.num_preemptions_total > 0}")
    assert ("cached_prefixes.py" in seen) == prefix
    assert ("block_pool.py" in seen) == prefix  # the cache's index; else the plain allocator
    assert ("sliding_window.py" in seen) == (window is not None)
    assert ("paged_memory.py" in seen) == track
    assert ("swap.py" in seen) == swap  # its free() forgets a finished request's CPU table
    assert ("preemption.py" in seen) == (sched.num_preemptions_total > 0)
    assert kv.num_free_blocks() == kv.num_blocks  # every block back in the pool


@settings(max_examples=40, deadline=None)
@given(
    max_loras=st.integers(0, 2),
    lookahead=st.integers(0, 3),
    async_scheduling=st.booleans(),
    requests=st.lists(
        st.tuples(st.integers(4, 12), st.integers(1, 8), st.integers(0, 3)), min_size=1, max_size=6
    ),
)
def test_a_step_enters_the_schedulers_optional_modules_exactly_when_on(
    max_loras, lookahead, async_scheduling, requests
):
    """lora_limit.py with max_loras, draft_slots.py with lookahead slots, placeholders.py when
    tokens come as async scheduling's placeholders (resolved before the next step)."""
    assume(not (lookahead and async_scheduling))  # the engine runs speculation synchronously
    kv = PagedKVCacheManager(16, BS, MAX_LEN)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=MAX_LEN,
                             num_lookahead_slots=lookahead, max_loras=max_loras)  # fmt: skip
    sched = Scheduler(kv, limits)
    reqs = [
        Request(f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                lora_int_id=lora, max_model_len=MAX_LEN)
        for i, (prompt_len, max_tokens, lora) in enumerate(requests)
    ]  # fmt: skip
    for req in reqs:
        sched.add_request(req)

    def run() -> None:
        for step in range(200):
            if not sched.has_unfinished():
                return
            out = sched.schedule(float(step))
            due = [s.request for s in out.scheduled if s.samples]
            if async_scheduling:
                sampled = {r.request_id: [PLACEHOLDER_TOKEN] for r in due}
                sched.update_from_output(out, sampled, float(step))
                sched.resolve_placeholders([(r, 1) for r in due], float(step))
            else:
                sched.update_from_output(out, {r.request_id: [1] for r in due}, float(step))
        raise AssertionError("the requests did not finish in 200 steps")

    seen = {p.name for p in files_run_by(run)}
    assert ("lora_limit.py" in seen) == bool(max_loras)
    assert ("draft_slots.py" in seen) == bool(lookahead)
    assert ("placeholders.py" in seen) == async_scheduling
    assert [r.output_token_ids for r in reqs] == [[1] * t for _, t, _ in requests]
    assert kv.num_free_blocks() == kv.num_blocks
