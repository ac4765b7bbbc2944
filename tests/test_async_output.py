"""Async output processing (``async_output_proc``): step N's outputs are made while step
N + 1's forward runs. The outputs must equal the synchronous engine's exactly (tokens, text,
logprobs, finish reasons, streamed deltas), arrive one step later, survive aborts, and be made
between the forward's launch and sampling."""

from __future__ import annotations

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.sampling_params import RequestOutputKind

PROMPTS = ["def add(a, b):", "import os\n", "class A:", "for i in range(3):"]


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded sampling with n > 1, logprobs, prompt logprobs and a stop string."""
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=1, stop=["\n\n"]),
        SamplingParams(temperature=1.0, seed=3, best_of=3, n=2, max_tokens=8, logprobs=1),
    ]


def summary(outs):
    rows = []
    for o in outs:
        lps = [[(t, round(lp.logprob, 5)) for t, lp in sorted(e.items())]
               for e in (o.prompt_logprobs or []) if e is not None]  # fmt: skip
        rows.append(("-".join(o.request_id.split("-")[:2]), lps, [
            (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.cumulative_logprob is None else round(c.cumulative_logprob, 5),
             [[(t, round(lp.logprob, 5), lp.decoded_token) for t, lp in sorted(e.items())]
              for e in c.logprobs or []])
            for c in o.outputs
        ]))  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def engines():
    """The built-in tiny model (it has a tokenizer, for text, stop strings and decoded
    logprobs), synchronous and asynchronous."""
    kw = dict(block_size=4, cpu_kv_cache_gib=0.01, seed=0)
    return LLM("tiny", **kw), LLM("tiny", async_output_proc=True, **kw)


def test_async_outputs_equal_sync_outputs(engines):
    sync, asyn = engines
    want = summary(sync.generate(PROMPTS, mixed_params(), use_tqdm=False))
    got = summary(asyn.generate(PROMPTS, mixed_params(), use_tqdm=False))
    assert got == want
    assert not asyn.llm_engine.has_unfinished_requests()


def stream(engine, params):
    """Every step's outputs of one DELTA request, and the concatenation of its deltas."""
    engine.add_request("s", "def f(x):", params)
    steps, text, ids = [], "", []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append([(o.request_id, o.finished) for o in outs])
        for o in outs:
            text += o.outputs[0].text if o.outputs else ""
            ids += o.outputs[0].token_ids if o.outputs else []
    return steps, text, ids


def test_streamed_deltas_are_the_same_one_step_later(engines):
    sync, asyn = engines
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    s_steps, s_text, s_ids = stream(sync.llm_engine, params)
    a_steps, a_text, a_ids = stream(asyn.llm_engine, params)
    assert (a_text, a_ids) == (s_text, s_ids) and len(s_ids) == 9
    assert a_steps[0] == [] and a_steps[1:] == s_steps  # each output one step later


def test_an_abort_while_outputs_are_pending_harms_no_other_request(engines):
    sync, asyn = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    finals = {}
    for name, llm in (("sync", sync), ("async", asyn)):
        engine = llm.llm_engine
        engine.add_request("keep", "import sys", params)
        engine.add_request("drop", "class B:", params)
        engine.step()
        engine.step()
        engine.abort_request("drop")  # its last step's outputs may be pending
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in done] == ["keep"]
        finals[name] = summary(done)
    assert finals["async"] == finals["sync"]


def test_outputs_are_made_between_the_forward_and_sampling(engines):
    _, asyn = engines
    engine = asyn.llm_engine
    runner, outputs = engine.runner, engine.outputs
    state = {"launched": False}  # inside execute, after the forward returned, before sampling
    seen: list[bool] = []
    forward, execute, make = runner._forward, runner.execute, outputs.outputs

    def spied_forward(*args, **kwargs):
        result = forward(*args, **kwargs)
        state["launched"] = True
        return result

    def spied_execute(*args, **kwargs):
        try:
            return execute(*args, **kwargs)
        finally:
            state["launched"] = False

    def spied_outputs(*args, **kwargs):
        seen.append(state["launched"])
        return make(*args, **kwargs)

    runner._forward, runner.execute, outputs.outputs = spied_forward, spied_execute, spied_outputs
    try:
        asyn.generate(["x = 1"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                      use_tqdm=False)  # fmt: skip
    finally:
        del runner._forward, runner.execute, outputs.outputs
    # 4 steps: the outputs of steps 1..3 are made inside steps 2..4, between the forward and
    # sampling; those of step 4 by the last call, which has nothing left to run
    assert seen == [True, True, True, False]


def test_the_flag_is_vllms_inverted_and_checked():
    from paged_llm.config import EngineConfig

    assert EngineConfig.from_kwargs(disable_async_output_proc=False).scheduler.async_output_proc
    with pytest.raises(ValueError, match="async_output_proc must be a bool"):
        EngineConfig.from_kwargs(async_output_proc="yes")


def test_a_kept_phase_profile_does_not_keep_the_engine_alive(tiny_llama):
    """The GPU check keeps the profile after shutting the engine down; with async outputs a
    step holds a closure over the engine, so the profile keeps marks only (an H100 run ran out
    of memory building the next engine while the profile held the last one's KV pools)."""
    import gc
    import weakref

    llm = LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01, async_output_proc=True,
              plugins=["paged_llm.engine.profile.StepPhaseProfile"])  # fmt: skip
    llm.generate([{"prompt_token_ids": [5, 9, 17]}], SamplingParams(max_tokens=3))
    profile = llm.llm_engine.core.plugins[-1]
    runner = weakref.ref(llm.llm_engine.runner)
    llm.shutdown()
    del llm
    gc.collect()
    assert runner() is None and profile.summary()["steps"] > 0
