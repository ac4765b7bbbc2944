"""AsyncEngine (the engine-loop thread) against a fake engine, without a model: delivery,
all-or-nothing adds, aborts on close, the waiting bound, shutdown and engine failure."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from paged_llm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.async_engine import AsyncEngine, SubRequest
from paged_llm.serve.errors import BadRequest, EngineUnavailable, ServerBusy
from paged_llm.serve.metrics import ServerMetrics
from paged_llm.serve.prompts import token_prompt


class FakeEngine:
    """LLMEngine's interface; each step emits token 7 for every request unless held."""

    def __init__(self):
        self.tokenizer = None
        self.max_model_len = 64
        self.clock = time.monotonic
        self.iteration_stats = []
        self.scheduler = SimpleNamespace(
            running=[], waiting=[], swapped=[], num_preemptions_total=0
        )
        self.live = {}  # id -> (prompt ids, params, output ids)
        self.aborted = []
        self.hold = False  # True: steps produce nothing (requests stay waiting)
        self.fail = False

    def add_request(self, rid, prompt, params, arrival_time=None):
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
            done = len(out) >= params.max_tokens
            if done:
                del self.live[rid]
            completion = CompletionOutput(0, "x" * len(out), list(out))
            completion.finish_reason = "length" if done else None
            metrics = RequestMetrics(0.0, 0.0, 0.0, 1.0 if done else None, [0.0] * len(out))
            outs.append(RequestOutput(rid, None, ids, [completion], done, metrics))
        return outs

    def abort_request(self, ids):
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.live.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.live)

    def kv_usage(self):
        return len(self.live) / 100


def sub(ids=(1, 2), max_tokens=3):
    return SubRequest(token_prompt(list(ids)), SamplingParams(max_tokens=max_tokens))


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
