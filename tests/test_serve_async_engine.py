"""AsyncEngine (the engine-loop thread) against a fake engine, without a model: delivery,
all-or-nothing adds, aborts on close, the waiting bound, shutdown and engine failure."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from paged_llm.engine.sleep_mode import SleepState
from paged_llm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.async_engine import AsyncEngine, RequestGroup, SubRequest, Update
from paged_llm.serve.errors import BadRequest, EngineUnavailable, ServerBusy
from paged_llm.serve.metrics import ServerMetrics
from paged_llm.serve.prompts import token_prompt
from paged_llm.serve.render import Choices


class FakeEngine:
    """LLMEngine's interface; each step emits token 7 for every sample of every request (a
    request has params.n samples; sample i stops i tokens early) unless held."""

    def __init__(self):
        self.tokenizer = None
        self.max_model_len = 64
        self.clock = time.monotonic
        self.iteration_stats = []
        self.scheduler = SimpleNamespace(
            running=[], waiting=[], swapped=[], num_preemptions_total=0,
            kv=SimpleNamespace(cache_stats=lambda: None),  # no prefix cache
        )  # fmt: skip
        self.lora = self.drafter = self.kv_connector = None  # features off
        self.sleep_state = SleepState()
        self.live = {}  # id -> (prompt ids, params, output ids)
        self.aborted = []
        self.hold = False  # True: steps produce nothing (requests stay waiting)
        self.fail = False

    def add_request(self, rid, prompt, params, arrival_time=None, priority=0, lora_request=None):
        ids = prompt["prompt_token_ids"]
        if 13 in ids:
            raise ValueError("token 13 is outside the vocabulary")
        self.live[rid] = (ids, params, [])

    def step(self):
        time.sleep(0.002)
        if self.fail:
            raise RuntimeError("boom")
        if self.hold:
            return []
        outs = []
        for rid, (ids, params, out) in list(self.live.items()):
            out.append(7)
            completions = [
                CompletionOutput(i, "x" * n, [7] * n, finish_reason=None)
                for i in range(params.n)
                for n in [min(len(out), params.max_tokens - i)]
            ]
            for i, c in enumerate(completions):
                c.finish_reason = "length" if len(out) >= params.max_tokens - i else None
            done = len(out) >= params.max_tokens
            if done:
                del self.live[rid]
            metrics = RequestMetrics(0.0, 0.0, 0.0, 1.0 if done else None, [0.0] * len(out))
            outs.append(RequestOutput(rid, None, ids, completions, done, metrics))
        return outs

    def abort_request(self, ids):
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.live.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.live)

    def kv_usage(self):
        return len(self.live) / 100


def sub(ids=(1, 2), max_tokens=3, n=1):
    return SubRequest(token_prompt(list(ids)), SamplingParams(max_tokens=max_tokens, n=n))


def run(fake, body, max_waiting=None):
    """Run ``body(async_engine)`` with a started engine loop, always shutting it down."""

    async def main():
        engine = AsyncEngine(fake, ServerMetrics("fake"), max_waiting=max_waiting)
        engine.start()
        try:
            return await asyncio.wait_for(body(engine), timeout=10)
        finally:
            await engine.shutdown(timeout=5)

    return asyncio.run(main())


def test_updates_arrive_in_order_until_every_choice_finishes():
    async def body(engine):
        group = await engine.submit([sub(max_tokens=3), sub(max_tokens=2)])
        seen = [
            (u.index, len(u.output.outputs[0].token_ids), u.finished) async for u in group.updates()
        ]
        group.close()
        return seen, engine.metrics.generation_tokens, engine.num_unstarted

    seen, generated, unstarted = run(FakeEngine(), body)
    assert [s for s in seen if s[0] == 0] == [(0, 1, False), (0, 2, False), (0, 3, True)]
    assert [s for s in seen if s[0] == 1] == [(1, 1, False), (1, 2, True)]
    assert generated == 5 and unstarted == 0


def test_n_samples_are_one_engine_request_counted_per_sample():
    fake = FakeEngine()
    fake.hold = True

    async def body(engine):
        group = await engine.submit([sub(max_tokens=3, n=3)])
        unstarted = engine.num_unstarted  # all 3 samples wait for the shared prompt
        fake.hold = False
        choices = Choices([group.subs[0].params])
        deltas = [d async for u in group.updates() for d in choices.apply(u)]
        group.close()
        m = engine.metrics
        return unstarted, deltas, choices, (m.prompt_tokens, m.generation_tokens, m.finished)

    unstarted, deltas, choices, (prompt, generated, finished) = run(fake, body)
    assert unstarted == 3 and len(fake.aborted) == 0
    # sample i has 3 - i tokens; a finished sample sends nothing more
    assert [(d.index, d.finish_reason) for d in deltas] == [
        (0, None), (1, None), (2, "length"), (0, None), (1, "length"), (0, "length"),
    ]  # fmt: skip
    assert prompt == 2 and generated == 3 + 2 + 1  # the prompt is counted once
    assert finished["length"] == 3
    assert choices.usage() == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


def test_closing_a_group_aborts_its_unfinished_samples():
    fake = FakeEngine()

    async def body(engine):
        group = await engine.submit([sub(max_tokens=50, n=4)])
        await anext(group.updates())
        group.close()
        for _ in range(200):  # the abort is applied between engine steps
            if not fake.live:
                break
            await asyncio.sleep(0.01)
        return engine.metrics.finished["abort"], engine.num_unstarted

    assert run(fake, body) == (4, 0)  # every sample counted as aborted
    assert len(fake.aborted) == 1 and fake.live == {}  # one engine request aborted


def test_a_bad_sub_request_rejects_the_whole_group():
    fake = FakeEngine()
    fake.hold = True

    async def body(engine):
        with pytest.raises(BadRequest, match="outside the vocabulary"):
            await engine.submit([sub(), sub(ids=(13,))])
        return engine.num_unstarted

    assert run(fake, body) == 0
    assert fake.live == {} and len(fake.aborted) == 1  # the good half was taken back


def test_prompt_plus_max_tokens_beyond_context_is_rejected():
    async def body(engine):
        with pytest.raises(BadRequest, match="maximum context length"):
            await engine.submit([sub(ids=range(1, 60), max_tokens=10)])

    run(FakeEngine(), body)


def test_closing_an_unfinished_group_aborts_it():
    fake = FakeEngine()

    async def body(engine):
        group = await engine.submit([sub(max_tokens=50), sub(max_tokens=50)])
        await anext(group.updates())
        group.close()
        for _ in range(200):  # the abort is applied between engine steps
            if not fake.live:
                break
            await asyncio.sleep(0.01)
        return engine.metrics.finished["abort"]

    assert run(fake, body) == 2
    assert fake.live == {} and len(fake.aborted) == 2


def test_waiting_requests_are_bounded():
    fake = FakeEngine()
    fake.hold = True

    async def body(engine):
        a = await engine.submit([sub()])
        b = await engine.submit([sub()])
        with pytest.raises(ServerBusy):
            await engine.submit([sub()])
        with pytest.raises(BadRequest, match="waiting limit"):  # could never fit
            await engine.submit([sub(), sub(), sub()])
        with pytest.raises(BadRequest, match="3 sequences"):  # n samples count separately
            await engine.submit([sub(n=3)])
        a.close()
        c = await engine.submit([sub()])  # room again
        b.close()
        c.close()
        return engine.num_unstarted

    assert run(fake, body, max_waiting=2) == 0


def test_shutdown_aborts_requests_in_flight():
    fake = FakeEngine()
    fake.hold = True

    async def body(engine):
        group = await engine.submit([sub()])
        await engine.shutdown(timeout=5)
        updates = [u async for u in group.updates()]
        with pytest.raises(EngineUnavailable):
            await engine.submit([sub()])
        return updates

    updates = run(fake, body)
    assert len(updates) == 1 and updates[0].aborted


def test_final_outputs_of_an_aborted_group_is_engine_unavailable():
    """A pooling request or a server beam step cut short by shutdown: a 503, not None outputs."""
    fake = FakeEngine()
    fake.hold = True

    async def body(engine):
        group = await engine.submit([sub(), sub()])
        await engine.shutdown(timeout=5)
        with pytest.raises(EngineUnavailable, match="stopped before the request finished"):
            await group.final_outputs()

    run(fake, body)


def test_engine_failure_fails_requests_and_refuses_new_ones():
    fake = FakeEngine()

    async def body(engine):
        fake.hold = True
        group = await engine.submit([sub()])
        fake.fail = True
        updates = [u async for u in group.updates()]
        for _ in range(100):
            if engine.dead is not None:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineUnavailable):
            await engine.submit([sub()])
        return updates, engine.is_running

    updates, running = run(fake, body)
    assert len(updates) == 1 and isinstance(updates[0].error, EngineUnavailable)
    assert not running


def test_a_cancelled_reader_stops_even_when_an_update_arrives_with_the_cancel():
    """A disconnect cancels the handler reading a group's updates. With asyncio.wait_for on
    Python 3.11, a cancel that arrived together with an update was swallowed: the handler read
    on, and the disconnected client's request ran to the end (a flaky serve test found it)."""

    async def main():
        group = RequestGroup(SimpleNamespace(thread_alive=True), "g", [sub()])
        task = asyncio.ensure_future(anext(group.updates()))
        await asyncio.sleep(0)  # the reader now waits for an update
        group.queue.put_nowait(Update(0))  # an update and the cancel, in the same loop turn
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        return task.cancelled()

    assert asyncio.run(main())
