"""Async scheduling's bookkeeping (plain Python): step N + 1 is planned while step N's tokens
are placeholders, and the tokens are written in a step later. A model stand-in whose next
token depends on the whole sequence must give every request the same outputs as the
synchronous scheduler, through preemption (recompute and swap), chunked prefill, prefix
caching, every policy, EOS and length stops, with no block leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.core.kv import POLICIES
from paged_llm.core.kv.paged import PagedKVCacheManager
from paged_llm.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from paged_llm.core.scheduler import Scheduler, SchedulerLimits
from paged_llm.sampling_params import SamplingParams
from paged_llm.utils.registry import import_target

EOS, VOCAB, MAX_LEN = 0, 7, 48


pytestmark = pytest.mark.usefixtures("quiet_preemption_warnings")


def next_token(seq: list[int]) -> int:
    """The stand-in model: a function of the whole sequence (so a wrong fed token shows)."""
    h = 17
    for t in seq:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def scheduler(policy: str, mode: str, chunked: bool, caching: bool, num_blocks: int) -> Scheduler:
    kw = {"enable_prefix_caching": True} if caching else {}
    kv_cls = PagedKVCacheManager if policy == "paged" else import_target(POLICIES[policy])
    kv = kv_cls(num_blocks=num_blocks, block_size=4, max_model_len=MAX_LEN, num_cpu_blocks=8,
                **kw)  # fmt: skip
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=12 if chunked else 64,
                             enable_chunked_prefill=chunked, preemption_mode=mode)  # fmt: skip
    return Scheduler(kv, limits)


def requests(specs: list[tuple[int, int, bool]]) -> list[Request]:
    return [
        Request(
            f"r{i}",
            [(i + j) % VOCAB for j in range(1, 1 + plen)],
            SamplingParams(max_tokens=mt, ignore_eos=ignore),
            eos_token_id=EOS,
            max_model_len=MAX_LEN,
        )  # fmt: skip
        for i, (plen, mt, ignore) in enumerate(specs)
    ]


def run_sync(s: Scheduler, reqs: list[Request], arrivals: list[int]) -> None:
    for step in range(3000):
        for r, at in zip(reqs, arrivals):
            if at == step:
                s.add_request(r)
        if not s.has_unfinished() and step > max(arrivals):
            return
        out = s.schedule(step)
        sampled = {x.request.request_id: [next_token(x.request.all_token_ids)]
                   for x in out.scheduled if x.samples}  # fmt: skip
        s.update_from_output(out, sampled, step)
    raise AssertionError("the synchronous run did not finish")


def run_async(s: Scheduler, reqs: list[Request], arrivals: list[int]) -> int:
    """The engine's pipelined order: plan and launch N + 1, then resolve N, then record N + 1
    with placeholders. The stand-in device feeds each placeholder its own sampled token."""
    in_flight: list[tuple[Request, int]] | None = None
    on_device: dict[str, int] = {}  # the last step's sampled ids, by request
    wasted = 0
    for step in range(3000):
        for r, at in zip(reqs, arrivals):
            if at == step:
                s.add_request(r)
        if not s.has_unfinished() and in_flight is None and step > max(arrivals):
            return wasted
        out = s.schedule(step) if s.has_unfinished() else None
        launched = []
        for x in out.scheduled if out else []:
            seq = list(x.request.all_token_ids)
            assert PLACEHOLDER_TOKEN not in seq[:-1], "only the last token may be unknown"
            if seq[-1] == PLACEHOLDER_TOKEN:
                seq[-1] = on_device[x.request.request_id]
            if x.samples:
                launched.append((x.request, next_token(seq)))
        if in_flight is not None:
            done = s.resolve_placeholders(in_flight, step)
            wasted += sum(1 for r in done for x in out.scheduled if x.request is r) if out else 0
        if out is not None:
            s.update_from_output(out, {r.request_id: [PLACEHOLDER_TOKEN] for r, _ in launched},
                                 step)  # fmt: skip
        on_device = {r.request_id: t for r, t in launched}
        in_flight = launched or None
        check_invariants(s)
    raise AssertionError("the pipelined run did not finish")


def check_invariants(s: Scheduler) -> None:
    for r in s.requests.values():
        unknown = r.output_token_ids.count(PLACEHOLDER_TOKEN)
        assert unknown <= 1 and (not unknown or r.output_token_ids[-1] == PLACEHOLDER_TOKEN)
        assert r.num_computed_tokens <= r.num_tokens
        assert r.final_token_pending == (
            unknown == 1 and r.num_output_tokens >= r.max_output_tokens
        )


@settings(max_examples=120, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.booleans()),
                   min_size=1, max_size=7),
    arrivals=st.lists(st.integers(0, 6), min_size=7, max_size=7),
    policy=st.sampled_from(["paged", "paged", "orca_max", "orca_oracle", "static"]),
    mode=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
    caching=st.booleans(),
    num_blocks=st.integers(12, 30),
)  # fmt: skip
def test_async_scheduling_gives_every_request_the_synchronous_outputs(
    specs, arrivals, policy, mode, chunked, caching, num_blocks
):
    if policy != "paged":  # reservations: one power-of-two run of blocks per request
        mode, caching, num_blocks = "recompute", False, 16 if num_blocks < 24 else 32
    arrivals = arrivals[: len(specs)]
    want, got = requests(specs), requests(specs)
    sync = scheduler(policy, mode, chunked, caching, num_blocks)
    pipelined = scheduler(policy, mode, chunked, caching, num_blocks)
    run_sync(sync, want, arrivals)
    run_async(pipelined, got, arrivals)
    for w, g in zip(want, got):
        assert (g.output_token_ids, g.status, g.stop_reason) == (
            w.output_token_ids, w.status, w.stop_reason
        ), g.request_id  # fmt: skip
        assert len(g.token_times) == len(g.output_token_ids)
    for s in (sync, pipelined):
        assert not s.has_unfinished() and s.kv.num_free_blocks() == s.kv.num_blocks


def test_a_length_finish_is_not_run_again_and_an_eos_costs_one_wasted_step():
    """A placeholder that reaches max_tokens stops the request from being scheduled; an EOS
    found a step late leaves one step's work for the request, then it is finished."""
    s = scheduler("paged", "recompute", False, False, 20)
    length, eos = requests([(3, 1, True), (3, 5, False)])
    s.add_request(length)
    s.add_request(eos)
    out = s.schedule(0)
    placeholders = {x.request.request_id: [PLACEHOLDER_TOKEN] for x in out.scheduled}
    s.update_from_output(out, placeholders, 0)
    assert length.final_token_pending and not eos.final_token_pending
    nxt = s.schedule(1)
    assert [x.request for x in nxt.scheduled] == [eos]  # the finished-by-length one waits
    done = s.resolve_placeholders([(length, 4), (eos, EOS)], 1)
    assert done == [length, eos]
    assert length.status is RequestStatus.FINISHED_LENGTH and length.output_token_ids == [4]
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [EOS]
    s.update_from_output(nxt, {"r1": [PLACEHOLDER_TOKEN]}, 1)  # the wasted step: skipped
    assert eos.output_token_ids == [EOS] and not s.has_unfinished()
    assert s.kv.num_free_blocks() == s.kv.num_blocks


def test_resolving_an_aborted_request_changes_nothing():
    s = scheduler("paged", "recompute", False, False, 20)
    (req,) = requests([(3, 5, True)])
    s.add_request(req)
    out = s.schedule(0)
    s.update_from_output(out, {"r0": [PLACEHOLDER_TOKEN]}, 0)
    s.abort_request("r0")
    assert s.resolve_placeholders([(req, 3)], 1) == []
    assert req.status is RequestStatus.FINISHED_ABORTED
