"""vLLM's AsyncLLMEngine: streamed outputs equal LLM.generate's, concurrent requests do not
disturb each other, leaving a loop early or abort() frees the request, bad input is a
ValueError that harms nobody, and an engine failure reaches every caller as RuntimeError."""

from __future__ import annotations

import asyncio

import pytest

from paged_llm import LLM, AsyncEngineArgs, AsyncLLMEngine, RequestOutputKind, SamplingParams

PROMPTS = ["def main():", "import os\n", {"prompt_token_ids": [5, 6, 7]}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def offline():
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def run(body, **engine_kwargs):
    """``body(engine)`` on a fresh AsyncLLMEngine of the tiny model, always shut down after."""

    async def main():
        args = AsyncEngineArgs(model="tiny", cpu_kv_cache_gib=0.01, **engine_kwargs)
        engine = AsyncLLMEngine.from_engine_args(args)
        try:
            return await asyncio.wait_for(body(engine), timeout=60)
        finally:
            await engine.shutdown(timeout=10)

    return asyncio.run(main())


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_streams_what_llm_generate_returns_for_concurrent_requests(offline):
    async def body(engine):
        runs = [collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*runs)

    for outs, want in zip(run(body), offline):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and len(outs) > 1  # cumulative, one step at a time
        last = outs[-1].outputs[0]
        assert (last.token_ids, last.text, last.finish_reason) == (
            want.token_ids, want.text, want.finish_reason
        )  # fmt: skip
    assert {o.request_id for o in outs} == {"r2"}


def test_delta_outputs_add_up(offline):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    outs = run(lambda engine: collect(engine, PROMPTS[0], params, "d"))
    assert "".join(o.outputs[0].text for o in outs) == offline[0].text
    assert [t for o in outs for t in o.outputs[0].token_ids] == offline[0].token_ids


def test_leaving_early_and_abort_free_the_request(offline):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body(engine):
        async for _ in engine.generate(PROMPTS[0], long, "left"):
            break  # the generator is closed here: its request is aborted

        async def aborted_later():
            outs = []
            async for out in engine.generate(PROMPTS[1], long, "aborted"):
                outs.append(out)
                if len(outs) == 2:
                    await engine.abort("aborted")
            return outs

        cut, done = await asyncio.gather(aborted_later(), collect(engine, PROMPTS[2], GREEDY, "ok"))
        for _ in range(200):  # the aborts reach the engine thread between steps
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        return cut, done, engine.engine.has_unfinished_requests(), engine.engine.kv_usage()

    cut, done, unfinished, usage = run(body)
    assert 2 <= len(cut) < 200 and not cut[-1].finished
    assert done[-1].outputs[0].token_ids == offline[2].token_ids
    assert not unfinished and usage == 0


def test_bad_input_is_a_value_error_and_harms_nobody(offline):
    async def body(engine):
        good = asyncio.create_task(collect(engine, PROMPTS[0], GREEDY, "good"))
        errors = []
        for prompt, params, rid in [
            ({"prompt_token_ids": []}, GREEDY, "empty"),
            ({"prompt_token_ids": [10**6]}, GREEDY, "vocab"),
            (PROMPTS[1], "not params", "params"),
            (PROMPTS[1], SamplingParams(max_tokens=5000), "capped"),
        ]:
            try:
                await collect(engine, prompt, params, rid)
            except ValueError as err:
                errors.append(rid)
                assert str(err)
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(engine, PROMPTS[1], GREEDY, "dup"),
                                 collect(engine, PROMPTS[1], GREEDY, "dup"))  # fmt: skip
        return errors, await good

    errors, good = run(body, max_model_len=64)
    assert errors == ["empty", "vocab", "params"]  # max_tokens is capped, as offline
    assert good[-1].outputs[0].token_ids == offline[0].token_ids


def test_an_engine_failure_reaches_every_caller():
    async def body(engine):
        def broken_step():
            raise RuntimeError("boom")

        engine.engine.step = broken_step
        with pytest.raises(RuntimeError, match="boom"):
            await collect(engine, PROMPTS[0], GREEDY, "x")
        assert engine.errored and not engine.is_running
        with pytest.raises(RuntimeError):
            await engine.check_health()
        with pytest.raises(RuntimeError):
            await collect(engine, PROMPTS[0], GREEDY, "y")
        return await engine.get_tokenizer()

    assert run(body) is not None


def test_priority_reaches_the_engine(offline):
    """generate(..., priority=k): refused on an FCFS engine, as vLLM does; served unchanged on a
    priority engine."""

    async def fcfs(engine):
        with pytest.raises(ValueError, match="scheduling_policy"):
            await collect_priority(engine, 1)

    async def prio(engine):
        return await collect_priority(engine, -5)

    async def collect_priority(engine, priority):
        gen = engine.generate(PROMPTS[0], GREEDY, f"p{priority}", priority=priority)
        return [out async for out in gen]

    run(fcfs)
    outs = run(prio, scheduling_policy="priority")
    assert outs[-1].outputs[0].token_ids == offline[0].token_ids


def test_sleep_mode_and_collective_rpc(offline):
    """vLLM's async methods: a sleeping engine refuses generate with RuntimeError, and after
    wake_up streams what it streamed before; bad levels and tags are ValueErrors."""

    async def body(engine):
        before = await collect(engine, PROMPTS[0], GREEDY, "a")
        assert await engine.collective_rpc(lambda runner: runner.block_size) == [16]
        assert await engine.reset_prefix_cache()
        with pytest.raises(ValueError, match="sleep level"):
            await engine.sleep(4)
        await engine.sleep(1)
        assert await engine.is_sleeping()
        with pytest.raises(RuntimeError, match="asleep"):
            await collect(engine, PROMPTS[0], GREEDY, "b")
        with pytest.raises(ValueError, match="unknown sleep tag"):
            await engine.wake_up(["kv"])
        await engine.wake_up()
        assert not await engine.is_sleeping()
        after = await collect(engine, PROMPTS[0], GREEDY, "c")
        return before[-1].outputs[0].token_ids, after[-1].outputs[0].token_ids

    before, after = run(body, enable_sleep_mode=True)
    assert before == after == offline[0].token_ids
