"""Property tests of the scheduler over every policy: thousands of random add / step / abort
sequences, checking the bookkeeping invariants after every operation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.core.kv import POLICIES
from paged_llm.core.kv.paged import NULL_BLOCK, PagedKVCacheManager, live_blocks
from paged_llm.core.request import Request, RequestStatus
from paged_llm.core.scheduler import Scheduler, SchedulerLimits
from paged_llm.sampling_params import SamplingParams
from paged_llm.utils.registry import import_target

EOS = 2
MAX_LEN = 64


pytestmark = pytest.mark.usefixtures("quiet_preemption_warnings")


def make_scheduler(policy, mode="recompute", num_blocks=24, block_size=4, chunked=False, **kw):
    window = {"sliding_window": kw["window"]} if kw.get("window") else {}
    kv = import_target(POLICIES[policy])(
        num_blocks=num_blocks, block_size=block_size, max_model_len=MAX_LEN, num_cpu_blocks=32,
        **window,
    )  # fmt: skip
    limits = SchedulerLimits(
        max_num_seqs=kw.get("max_num_seqs", 6),
        max_num_batched_tokens=kw.get("budget", 64),
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        scheduling_policy=kw.get("scheduling_policy", "fcfs"),
        max_loras=kw.get("max_loras", 0),
    )
    return Scheduler(kv, limits, track_memory=True)


def make_request(rid, prompt_len, max_tokens, ignore_eos=True, priority=0, arrival=0.0, lora=0):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(str(rid), [7] * prompt_len, params, eos_token_id=EOS, max_model_len=MAX_LEN,
                   priority=priority, arrival_time=arrival, lora_int_id=lora)  # fmt: skip


def check_priority_order(s: Scheduler, before: set[str], out):
    """Priority scheduling: the waiting queue stays sorted; requests admitted this step come
    from its front; preempted requests were the least urgent of those running."""
    key = s.queue.key
    keys = [key(r) for r in s.waiting]
    assert keys == sorted(keys)
    admitted = [r for r in s.running if r.request_id not in before]
    # a request whose adapter found no free slot waits without holding back later ones
    loras = {r.lora_int_id for r in s.running if r.lora_int_id}
    unblocked = [
        key(r) for r in s.waiting
        if not s.limits.max_loras or not r.lora_int_id or r.lora_int_id in loras
        or len(loras) < s.limits.max_loras
    ]  # fmt: skip
    if admitted and unblocked and not out.swap_in:
        assert max(key(r) for r in admitted) <= min(unblocked)
    preempted = [s.requests[rid] for rid in out.preempted if rid in s.requests]
    if preempted and s.running:
        assert max(key(r) for r in s.running) <= min(key(r) for r in preempted)


def check_sliding_window(s: Scheduler):
    """Blocks before a sequence's window are freed (NULL_BLOCK), and none it may still read
    is: its window from the last computed token on (a fork may recompute that token)."""
    kv, window = s.kv, s.kv.sliding_window
    for r in s.running:
        table = kv.get_block_table(r)
        first_read = max(0, r.num_computed_tokens - window) // kv.block_size  # a block index
        assert all(b == NULL_BLOCK for b in table[:first_read])
        assert NULL_BLOCK not in table[first_read:]
        assert len(live_blocks(table)) <= kv.blocks_at_most(r.max_total_tokens)


def check_invariants(s: Scheduler):
    kv = s.kv
    held = [b for t in kv.block_tables.values() for b in live_blocks(t)]
    live = {r.request_id for r in s.running}
    assert set(kv.block_tables) <= live | {r.request_id for r in s.waiting}
    if kv.name == "paged":  # shared blocks: one reference per owning table
        refs = [0] * kv.num_blocks
        for b in held:
            refs[b] += 1
        assert refs == kv.pool.ref_counts
        assert kv.num_free_blocks() == sum(c == 0 for c in refs)
    else:
        assert len(held) == len(set(held)), "a block is owned twice"
    for r in s.running:
        assert len(kv.get_block_table(r)) * kv.block_size >= r.num_computed_tokens
    mem = kv.memory_breakdown(s.running)
    assert mem.total == kv.num_slots
    assert min(mem.token_states, mem.reservation, mem.internal_fragmentation) >= 0
    assert mem.external_fragmentation >= 0
    if kv.name == "paged":  # waste only in each request's last block
        assert mem.internal_fragmentation < kv.block_size * max(1, len(s.running))
    assert len(s.running) <= s.limits.max_num_seqs
    if s.limits.max_loras:
        assert len({r.lora_int_id for r in s.running if r.lora_int_id}) <= s.limits.max_loras
    if getattr(kv, "sliding_window", None):
        check_sliding_window(s)


def run_ops(s: Scheduler, ops, rng_tokens):
    step = 0
    added = 0
    for op, a, b in ops:
        if op == 0:
            lora = (a // 3) % 4 if s.limits.max_loras else 0  # 0 = the base model
            s.add_request(make_request(added, 1 + a % 40, 1 + b % 30, ignore_eos=b % 3 != 0,
                                       priority=a % 3, arrival=float(added),
                                       lora=lora))  # fmt: skip
            added += 1
        elif op == 1 and s.has_unfinished():
            before = {r.request_id for r in s.running}
            out = s.schedule(step)
            if s.queue.name == "priority":
                check_priority_order(s, before, out)
            assert out.num_batched_tokens <= s.limits.max_num_batched_tokens
            assert len(out.scheduled) <= s.limits.max_num_seqs
            sampled = {
                x.request.request_id: [rng_tokens[(step + i) % len(rng_tokens)]]
                for i, x in enumerate(out.scheduled)
                if x.samples
            }
            s.update_from_output(out, sampled, step)
            step += 1
        elif op == 2 and s.requests:
            rid = sorted(s.requests)[a % len(s.requests)]
            s.abort_request(rid)
        elif op == 3 and s.kv.supports_sharing and s.running:  # fork a sample / beam
            parent = s.running[a % len(s.running)]
            if parent.num_computed_tokens == parent.num_tokens and parent.num_output_tokens:
                parent.group_id = parent.group_id or parent.request_id
                child = make_request(
                    f"c{added}",
                    parent.num_prompt_tokens,
                    1 + b % 30,
                    priority=parent.priority,
                    arrival=parent.arrival_time,
                    lora=parent.lora_int_id,
                )
                added += 1
                child.output_token_ids = list(parent.output_token_ids)
                child.num_computed_tokens = parent.num_computed_tokens - 1  # redo the last token
                child.group_id = parent.group_id
                s.fork_request(parent, child)
        check_invariants(s)
    # drain: every admitted request eventually finishes
    for _ in range(5000):
        if not s.has_unfinished():
            break
        out = s.schedule(step)
        sampled = {x.request.request_id: [5] for x in out.scheduled if x.samples}
        s.update_from_output(out, sampled, step)
        check_invariants(s)
        step += 1
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks() == s.kv.num_blocks


POLICY_MODES = [("paged", "recompute"), ("paged", "swap")] + [
    (p, "recompute") for p in ("orca_max", "orca_pow2", "orca_oracle", "static")
]


@pytest.mark.parametrize("policy,mode", POLICY_MODES)
@pytest.mark.parametrize("chunked", [False, True])
@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from([0, 1, 1, 1, 2, 3]), st.integers(0, 99), st.integers(0, 99)),
        max_size=80,
    ),
    tokens=st.lists(st.sampled_from([EOS, 5, 6]), min_size=1, max_size=8),
)
def test_random_operations_keep_invariants(policy, mode, chunked, ops, tokens):
    s = make_scheduler(policy, mode, chunked=chunked, budget=16 if chunked else 64)
    run_ops(s, ops, tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [False, True])
@settings(max_examples=150, deadline=None)
@given(
    window=st.sampled_from([1, 3, 6, 13]),
    ops=st.lists(
        st.tuples(st.sampled_from([0, 1, 1, 1, 2, 3]), st.integers(0, 99), st.integers(0, 99)),
        max_size=80,
    ),
    tokens=st.lists(st.sampled_from([EOS, 5, 6]), min_size=1, max_size=8),
)
def test_sliding_window_frees_blocks_and_keeps_invariants(mode, chunked, window, ops, tokens):
    """A paged pool whose model attends to its last ``window`` positions: blocks before every
    running sequence's window are back in the pool after each operation, none it still reads
    is, and forks, swaps, aborts and recomputation keep reference counts exact. With chunked
    prefill the pool (12 blocks, 48 slots) is smaller than the longest requests (64 tokens):
    they hold at most their window plus one chunk, and still finish."""
    s = make_scheduler("paged", mode, num_blocks=12 if chunked else 16, chunked=chunked,
                       budget=16 if chunked else 64, window=window)  # fmt: skip
    run_ops(s, ops, tokens)


@pytest.mark.parametrize("policy,mode", [("paged", "recompute"), ("paged", "swap"),
                                         ("orca_oracle", "recompute")])  # fmt: skip
@pytest.mark.parametrize("chunked", [False, True])
@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from([0, 0, 1, 1, 1, 2, 3]), st.integers(0, 99), st.integers(0, 99)),
        max_size=80,
    ),
    tokens=st.lists(st.sampled_from([EOS, 5, 6]), min_size=1, max_size=8),
)
def test_priority_scheduling_keeps_invariants_and_order(policy, mode, chunked, ops, tokens):
    """The same random operations under priority scheduling: no leak, every request finishes,
    and the queue order and preemption victims follow (priority, arrival time)."""
    s = make_scheduler(policy, mode, num_blocks=16, chunked=chunked, budget=16 if chunked else 64,
                       scheduling_policy="priority")  # fmt: skip
    run_ops(s, ops, tokens)


@pytest.mark.parametrize("policy,mode", [("paged", "recompute"), ("paged", "swap"),
                                         ("orca_pow2", "recompute")])  # fmt: skip
@pytest.mark.parametrize("max_loras", [1, 2])
@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from([0, 0, 1, 1, 1, 2, 3]), st.integers(0, 99), st.integers(0, 99)),
        max_size=80,
    ),
    tokens=st.lists(st.sampled_from([EOS, 5, 6]), min_size=1, max_size=8),
    priority=st.booleans(),
)
def test_lora_limit_keeps_invariants(policy, mode, max_loras, ops, tokens, priority):
    """Requests on three adapters and the base model: never more than max_loras adapters run
    at once (checked after every operation), no leak, and every request still finishes."""
    s = make_scheduler(policy, mode, num_blocks=16, max_loras=max_loras,
                       scheduling_policy="priority" if priority else "fcfs")  # fmt: skip
    run_ops(s, ops, tokens)


def test_lora_limit_lets_other_adapters_pass_a_blocked_one():
    """With one slot taken by adapter 1, adapter 2's request waits while a later request of
    adapter 1 and one of the base model are admitted past it (vLLM's behaviour)."""
    s = make_scheduler("paged", num_blocks=32, max_loras=1)
    for rid, lora in (("a", 1), ("b", 2), ("c", 1), ("d", 0)):
        s.add_request(make_request(rid, 4, 8, lora=lora))
    out = s.schedule(0)
    assert [x.request.request_id for x in out.scheduled] == ["a", "c", "d"]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_priority_admits_urgent_first_and_preempts_the_least_urgent():
    s = make_scheduler("paged", num_blocks=16, max_num_seqs=2, scheduling_policy="priority")
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2)):
        s.add_request(make_request(rid, 4, 30, priority=prio))
    out = s.schedule(0)
    assert [x.request.request_id for x in out.scheduled] == ["high", "mid"]
    for step in range(1, 40):  # 2 x (4 + 30) tokens need 18 blocks of 4, the pool has 16
        out = s.schedule(step)
        if out.preempted:
            assert out.preempted == ["mid"] and [r.request_id for r in s.waiting] == ["mid", "low"]
            break
        s.update_from_output(out, {x.request.request_id: [5] for x in out.scheduled}, step)
    else:
        raise AssertionError("expected a preemption")


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerLimits(scheduling_policy="lifo")


def test_request_that_can_never_fit_is_rejected():
    # the pool is at least max_model_len (checked at start-up), so a prompt that fills it
    # alone is one that leaves no room to generate: it is rejected before it is queued
    with pytest.raises(ValueError, match="max_model_len"):
        make_request(0, MAX_LEN, 1)
    s = make_scheduler("paged", num_blocks=16, block_size=4)
    s.kv.num_blocks = 15  # a policy whose pool shrank below the request's need
    with pytest.raises(ValueError, match="can never run"):
        s.add_request(make_request(1, MAX_LEN - 1, 1))
    assert not s.waiting


def test_pool_smaller_than_max_model_len_is_an_error():
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler("paged", num_blocks=8, block_size=4)


@pytest.mark.parametrize("policy", ["orca_max", "orca_pow2", "orca_oracle", "static"])
def test_a_pool_without_a_run_for_one_max_length_reservation_is_an_error(policy):
    """A 48-token reservation is 24 blocks of 2, taken as a 32-block buddy run. A 30-block pool
    (runs of 16 + 8 + 4 + 2) holds 60 slots but no such run; Orca (Max) once accepted requests
    there that then waited forever. 32 and 40 (32 + 8) blocks do hold one."""
    kv_cls = import_target(POLICIES[policy])
    limits = SchedulerLimits(max_num_batched_tokens=64)
    for num_blocks, ok in ((30, False), (31, False), (32, True), (40, True)):
        kv = kv_cls(num_blocks=num_blocks, block_size=2, max_model_len=48)
        if ok:
            Scheduler(kv, limits)
        else:
            with pytest.raises(ValueError, match="largest run"):
                Scheduler(kv, limits)


def test_paged_preempts_most_recent_and_recompute_resets_progress():
    s = make_scheduler("paged", "recompute", num_blocks=16, block_size=4, max_num_seqs=8)
    for i in range(4):
        s.add_request(make_request(i, 12, 40))
    preempted = []
    for step in range(200):
        if not s.has_unfinished():
            break
        out = s.schedule(step)
        preempted += out.preempted
        s.update_from_output(out, {x.request.request_id: [5] for x in out.scheduled}, step)
    assert preempted, "the workload should overflow the pool"
    assert preempted[0] == "3"  # the most recently admitted goes first
    assert not s.has_unfinished()


def test_swap_moves_all_blocks_and_back():
    s = make_scheduler("paged", "swap", num_blocks=16, block_size=4, max_num_seqs=8)
    for i in range(4):
        s.add_request(make_request(i, 12, 40))
    out_blocks = in_blocks = 0
    for step in range(300):
        if not s.has_unfinished():
            break
        out = s.schedule(step)
        out_blocks += len(out.swap_out)
        in_blocks += len(out.swap_in)
        s.update_from_output(out, {x.request.request_id: [5] for x in out.scheduled}, step)
    assert out_blocks > 0 and out_blocks == in_blocks
    assert s.kv.cpu_pool.num_free == s.kv.cpu_pool.num_blocks


def test_orca_reservations_and_breakdown():
    s = make_scheduler("orca_pow2", num_blocks=32, block_size=4)
    s.add_request(make_request("a", 10, 5))  # reserves 10 + 8 = 18 slots -> 5 blocks -> run of 8
    out = s.schedule(0)
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    mem = s.kv.memory_breakdown(s.running)
    assert mem.token_states == 10
    assert mem.reservation == 5
    assert mem.internal_fragmentation == 3
    assert mem.total == 128


def test_static_batching_waits_for_whole_batch():
    s = make_scheduler("static", num_blocks=48, block_size=4, max_num_seqs=8)  # 3 x 64 slots
    for i in range(5):
        s.add_request(make_request(i, 4, 3 + 10 * (i == 0)))
    out = s.schedule(0)
    assert len(out.scheduled) == 3  # the largest batch that fits at max length
    admitted_later = []
    for step in range(1, 100):
        if not s.has_unfinished():
            break
        s.update_from_output(out, {x.request.request_id: [5] for x in out.scheduled}, step)
        out = s.schedule(step)
        new = [x.request.request_id for x in out.scheduled if x.request.num_computed_tokens == 0]
        if new:
            admitted_later.append((step, new))
    # requests 3 and 4 start only after request 0 (13 tokens) finished
    assert admitted_later and admitted_later[0][0] >= 13


@pytest.mark.parametrize("chunked", [True, False])
def test_a_group_larger_than_one_steps_budget_is_still_admitted(chunked):
    """A group waits whole (after a preemption by recomputation each member recomputes its
    whole sequence). If its members' tokens exceed one step's budget, the members the budget
    cannot take this step start in the next ones; waiting for a step that takes them all
    waited forever (found by the engine's add/step/abort fuzz test)."""
    budget = 16 if chunked else MAX_LEN  # unchunked, one prompt must fit a step
    s = make_scheduler("paged", num_blocks=48, chunked=chunked, budget=budget)
    group = [make_request(f"g{i}", budget - 4, 4) for i in range(3)]
    for req in group:
        req.group_id = "g"
        s.add_request(req)
    for step in range(30):
        out = s.schedule(step)
        s.update_from_output(out, {x.request.request_id: [5] for x in out.scheduled}, step)
        assert out.num_batched_tokens <= budget
        check_invariants(s)
        if not s.has_unfinished():
            break
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in group)


def test_abort_releases_everything():
    s = make_scheduler("paged", num_blocks=32)
    for i in range(3):
        s.add_request(make_request(i, 10, 10))
    out = s.schedule(0)
    s.update_from_output(out, {x.request.request_id: [5] for x in out.scheduled}, 0)
    for rid in list(s.requests):
        assert s.abort_request(rid).status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks() == s.kv.num_blocks and not s.has_unfinished()


def test_overhead_microbenchmark_runs():
    from experiments.sched_overhead import measure

    r = measure(
        num_running=8, iterations=5, policy="paged", block_size=16, prompt_len=4, max_model_len=64
    )
    assert r["iterations"] == 4 and r["mean_ms"] > 0 and r["num_running"] == 8


@pytest.mark.parametrize("policy", ["paged", "orca_oracle"])
@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=10),
    accept=st.lists(st.integers(0, 3), min_size=1, max_size=20),
    cap=st.one_of(st.none(), st.integers(1, 6)),
)
def test_lookahead_slots_roll_back(policy, lens, accept, cap):
    """Draft slots are freed after rejections; with ``spec_disable_batch_size`` a step that
    starts with that many running requests reserves none."""
    kv = import_target(POLICIES[policy])(num_blocks=40, block_size=4, max_model_len=MAX_LEN)
    s = Scheduler(kv, SchedulerLimits(max_num_seqs=6, max_num_batched_tokens=64,
                                      num_lookahead_slots=3, spec_disable_batch_size=cap),
                  track_memory=True)  # fmt: skip
    for i, (p, o) in enumerate(lens):
        s.add_request(make_request(i, p, o))
    step = 0
    while s.has_unfinished():
        running = len(s.running)
        out = s.schedule(step)
        if cap is not None and running >= cap:
            assert not any(x.num_lookahead for x in out.scheduled)
        sampled = {}
        for j, x in enumerate(out.scheduled):
            if x.num_lookahead:  # a drafter proposed some tokens; some were accepted
                drafts = [9] * (1 + (step + j) % x.num_lookahead)
                x.request.spec_token_ids = drafts
                x.num_new_tokens = 1 + len(drafts)
                n_acc = min(accept[(step + j) % len(accept)], len(drafts))
                sampled[x.request.request_id] = drafts[:n_acc] + [5]
            elif x.samples:
                sampled[x.request.request_id] = [5]
        s.update_from_output(out, sampled, step)
        check_invariants(s)
        for r in s.running:  # no block is kept for rejected drafts
            assert r.num_computed_tokens <= r.num_tokens
            if policy == "paged" and r.num_output_tokens:
                assert len(kv.get_block_table(r)) <= kv.blocks_for(r.num_tokens)
        step += 1
        assert step < 2000
    assert kv.num_free_blocks() == kv.num_blocks


def test_fork_sample_shares_the_prompt_and_recomputes_its_last_token():
    """A parallel sample forked as the first sample's prefill completes holds the same blocks
    and recomputes only the last prompt token; the block both then write is copied once."""
    kv = PagedKVCacheManager(8, 4, max_model_len=32)
    s = Scheduler(kv, SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32))
    prompt = list(range(1, 10))  # 9 tokens: blocks 0-1 full, block 2 holds one
    first = Request("a", prompt, SamplingParams(max_tokens=4), max_model_len=32, group_id="a")
    sample = Request("a#1", prompt, SamplingParams(max_tokens=4), max_model_len=32, group_id="a")
    s.add_request(first)
    out = s.schedule(0.0)
    s.fork_sample(first, sample)
    assert sample.num_computed_tokens == len(prompt) - 1
    table = list(kv.get_block_table(first))
    assert kv.get_block_table(sample) == table and all(kv.pool.ref_counts[b] == 2 for b in table)
    s.update_from_output(out, {"a": [5]}, 0.0)
    out = s.schedule(1.0)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"a": 1, "a#1": 1}
    assert len(out.copy_blocks) == 1 and out.copy_blocks[0][0] == table[2]
