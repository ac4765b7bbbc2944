"""Async scheduling in the engine (``async_scheduling=True``): step N + 1 is planned and
launched before step N's tokens reach the host; the runner feeds N's sampled ids into N + 1's
placeholders on the device. Outputs must equal the synchronous engine's exactly (tokens, text,
finish reasons, logprobs where asked), through stops found a step late, preemption, chunked
prefill, prefix caching, steps that must sample on the host, aborts, and replayed graph
buffers."""

from __future__ import annotations

import pytest
from graph_replay import replay_graphs_eagerly

from paged_llm import LLM, SamplingParams
from paged_llm.config import EngineConfig
from paged_llm.runner import async_tokens
from paged_llm.sampling_params import RequestOutputKind

PROMPTS = ["def add(a, b):", "import os\n", "class A:", "for i in range(3):", "x = [1, 2"]
KW = dict(block_size=4, cpu_kv_cache_gib=0.01, seed=0)


def finals(outs):
    """Each output's completions; offline request ids (which differ per LLM) left out."""
    rows = []
    for o in outs:
        rid = None if o.request_id.startswith("offline") else o.request_id
        rows.append((rid, [
            (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.cumulative_logprob is None else round(c.cumulative_logprob, 4))
            for c in o.outputs
        ]))  # fmt: skip
    return rows


def same_outputs_both_ways(params: list[SamplingParams]) -> tuple[list, LLM]:
    """Generate PROMPTS synchronously and with async scheduling; check the outputs (tokens,
    text, finishes, logprobs, prompt logprobs) are equal; the async outputs and engine."""
    want = LLM("tiny", **KW).generate(PROMPTS, params, use_tqdm=False)
    pipelined = LLM("tiny", async_scheduling=True, **KW)
    got = pipelined.generate(PROMPTS, params, use_tqdm=False)
    assert finals(got) == finals(want)
    for g, w in zip(got, want):
        assert [c.logprobs for c in g.outputs] == [c.logprobs for c in w.outputs]
        assert g.prompt_logprobs == w.prompt_logprobs
    return got, pipelined


def plain_params(stop_token: int | None = None) -> list[SamplingParams]:
    """Greedy and seeded sampling, EOS allowed, a stop token, a stop string, lengths."""
    stops = [stop_token] if stop_token is not None else []
    return [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stops),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=28, stop=["\n"]),
        SamplingParams(temperature=1.0, seed=9, top_p=0.9, max_tokens=16, ignore_eos=True),
    ]


def test_plain_requests_run_deferred_and_equal_the_synchronous_engine():
    sync, pipelined = LLM("tiny", **KW), LLM("tiny", async_scheduling=True, **KW)
    first = sync.generate(PROMPTS, plain_params(), use_tqdm=False)
    stop = first[1].outputs[0].token_ids[5]  # a token request 1 meets mid-output: a stop
    want = finals(sync.generate(PROMPTS, plain_params(stop), use_tqdm=False))
    got = finals(pipelined.generate(PROMPTS, plain_params(stop), use_tqdm=False))
    assert got == want
    reasons = {c[3] for _, cs in want for c in cs}
    assert want[1][1][0][4] == stop and reasons >= {"stop", "length"}
    # every decode step left its ids on the device
    assert pipelined.llm_engine.runner.deferred_steps > 20
    engine = pipelined.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0


def test_requests_that_sample_on_the_host_make_their_steps_synchronous():
    """Logprobs, penalties, n > 1 and min_tokens beside plain requests: the same outputs; the
    steps without them still defer."""
    params = [
        SamplingParams(temperature=0, max_tokens=14, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=6),
        SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=1),
    ]
    got, pipelined = same_outputs_both_ways(params)
    assert all(o.prompt_logprobs is not None for o in got[4:])
    assert pipelined.llm_engine.runner.deferred_steps > 0  # once the host-sampled ones finish


def test_processing_that_needs_only_the_output_count_still_defers():
    """min_tokens, logit_bias, allowed_token_ids and a one-token bad word read how many tokens
    came out, not which: their steps leave the ids on the device (placeholders count as
    outputs) and the outputs equal the synchronous engine's, also where min_tokens and the
    whitelist conflict (the whitelist wins)."""
    tok = LLM("tiny", **KW).get_tokenizer()
    eos = tok.eos_token_id
    word = next(w for w in ("x", "a", "e") if len(tok.encode(w, add_special_tokens=False)) == 1)
    params = [
        SamplingParams(temperature=0, max_tokens=20, min_tokens=12),
        SamplingParams(temperature=0.9, seed=3, max_tokens=16, logit_bias={7: 5.0, eos: -50.0}),
        SamplingParams(temperature=1.0, seed=4, max_tokens=12, allowed_token_ids=[eos, 7, 9, 30]),
        SamplingParams(temperature=0, max_tokens=16, bad_words=[word]),
        SamplingParams(temperature=1, seed=5, max_tokens=8, min_tokens=4, allowed_token_ids=[eos]),
    ]
    got, pipelined = same_outputs_both_ways(params)
    assert [len(o.outputs[0].token_ids) for o in got][4] == 4  # four EOS, then the stop
    runner = pipelined.llm_engine.runner
    assert runner.deferred_steps >= 15  # every decode step, all requests constrained
    assert not async_tokens.can_defer(
        [_request(SamplingParams(logits_processors=[lambda out, row: row])), _request(None)]
    )


def test_penalties_count_the_token_still_on_the_device():
    """Repetition, frequency and presence penalties read the output tokens, the last of which
    is still on the device when the next step samples: it is counted there. Every decode step
    defers and the outputs equal the synchronous engine's."""
    params = [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=20, frequency_penalty=1.2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=18, presence_penalty=1.5, top_p=0.9),
        SamplingParams(temperature=0, max_tokens=22, frequency_penalty=-0.8, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=16),
    ]
    got, pipelined = same_outputs_both_ways(params)
    plain = LLM("tiny", **KW).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24))
    assert got[0].outputs[0].token_ids != plain[0].outputs[0].token_ids  # the penalty bit
    assert pipelined.llm_engine.runner.deferred_steps >= 20


def test_bad_words_of_several_tokens_compare_the_held_token_on_the_device():
    """A bad word of several tokens is matched against the output's end, whose last token is
    still on the device: it is compared there, the step defers, and the word is banned where
    the synchronous engine bans it."""
    llm = LLM("tiny", **KW)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    texts = [tok.decode(tokens[i : i + 3]) for i in range(2, 8)]  # words from the output
    word = next(t for t in texts if len(tok.encode(t, add_special_tokens=False)) > 1)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])] * 5
    got, pipelined = same_outputs_both_ways(params)
    assert got[0].outputs[0].token_ids != tokens  # the ban changed the output
    assert pipelined.llm_engine.runner.deferred_steps >= 10


def test_prompt_logprobs_come_to_the_host_with_the_deferred_ids(monkeypatch):
    """Prompt logprobs are packed on the device and copied with the sampled ids, so a step
    with them defers like any other: the synchronous read (runner.batch.prompt_logprobs) is
    never called, and the values equal the synchronous engine's."""
    from paged_llm.runner import model_runner

    params = [
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=k) for k in (0, 2, 1, 3, 0)
    ]
    want = LLM("tiny", **KW).generate(PROMPTS, params, use_tqdm=False)
    pipelined = LLM("tiny", async_scheduling=True, **KW)

    def read_now(*args):
        raise AssertionError("prompt logprobs read synchronously")

    monkeypatch.setattr(model_runner, "prompt_logprobs", read_now)
    got = pipelined.generate(PROMPTS, params, use_tqdm=False)
    assert finals(got) == finals(want)
    assert [g.prompt_logprobs for g in got] == [w.prompt_logprobs for w in want]
    assert all(g.prompt_logprobs[1] for g in got if len(g.prompt_token_ids) > 1)
    assert pipelined.llm_engine.runner.deferred_steps >= 6


def _request(params: SamplingParams | None):
    from paged_llm.core.request import Request

    return Request("r", [1], params or SamplingParams())


@pytest.mark.parametrize(
    "engine_args",
    [
        {"preemption_mode": "recompute"},
        {"preemption_mode": "swap", "swap_space": 1.0},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 6},
        {"enable_prefix_caching": True, "enable_chunked_prefill": True,
         "max_num_batched_tokens": 8},
    ],
    ids=["recompute", "swap", "chunked", "prefix_cache"],
)  # fmt: skip
def test_preemption_chunking_and_caching_keep_the_outputs(engine_args):
    """A 20-block pool for five requests of up to ~50 tokens: requests are preempted (and
    swapped) while their last token is still on the device."""
    kw = dict(KW, num_gpu_blocks_override=20, max_model_len=64, max_num_seqs=5, **engine_args)
    prompts = PROMPTS * 2
    params = [SamplingParams(temperature=0, max_tokens=36, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=30)] * 5  # fmt: skip
    sync, pipelined = LLM("tiny", **kw), LLM("tiny", async_scheduling=True, **kw)
    for _ in range(2):  # the second round finds the first's prefixes cached
        want = finals(sync.generate(prompts, params, use_tqdm=False))
        assert finals(pipelined.generate(prompts, params, use_tqdm=False)) == want
    engine = pipelined.llm_engine
    assert engine.scheduler.kv.num_free_blocks() == engine.num_kv_blocks
    if "preemption_mode" in engine_args:
        assert engine.scheduler.num_preemptions_total > 0
    if engine_args.get("enable_prefix_caching"):
        assert engine.scheduler.kv.prefix_hits > 0
    assert engine.runner.deferred_steps > 0


def test_placeholders_are_fed_into_replayed_graph_buffers(tiny_llama, monkeypatch):
    """Decode graphs and mixed-step graphs (their static buffers replayed eagerly): the fed
    ids land in the graphs' input buffer, and the tokens equal the synchronous eager run's."""
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 2 + i] * (i + 1)} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 4, 9, 6)]
    kw = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01, max_num_seqs=4,
              attention_backend="triton", dtype="float32")  # fmt: skip
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama[0]), **kw).generate(
        prompts, params, use_tqdm=False)]  # fmt: skip
    llm = LLM(str(tiny_llama[0]), async_scheduling=True, **kw)
    replay_graphs_eagerly(llm, monkeypatch, [1, 2, 4], mixed_tokens=[16, 32, 48])
    engine, got = llm.llm_engine, {}
    for i, (p, sp) in enumerate(zip(prompts, params)):  # one arrival per step: mixed steps
        engine.add_request(str(i), p, sp)
        got.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        got.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [got[str(i)] for i in range(4)] == want
    kinds = engine.runner.forward_kinds
    assert kinds["graph"] > 0 and kinds["graph_mixed"] > 0


def test_an_abort_while_a_step_is_in_flight_harms_no_other_request():
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = {}
    for name, llm in (("sync", LLM("tiny", **KW)),
                      ("async", LLM("tiny", async_scheduling=True, **KW))):  # fmt: skip
        engine = llm.llm_engine
        engine.add_request("keep", "import sys", params)
        engine.add_request("drop", "class B:", params)
        engine.step()
        engine.step()
        engine.abort_request("drop")  # with async scheduling its step is still in flight
        engine.add_request("drop", "class C:", params)  # the id again, for a new request
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        results[name] = sorted(finals(done))
        assert engine.kv_usage() == 0
    assert results["async"] == results["sync"]


def test_streamed_deltas_are_the_same_one_step_later():
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    runs = []
    for llm in (LLM("tiny", **KW), LLM("tiny", async_scheduling=True, **KW)):
        engine = llm.llm_engine
        engine.add_request("s", "def f(x):", params)
        steps, ids = [], []
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps.append([(o.request_id, o.finished) for o in outs])
            ids += [t for o in outs for t in o.outputs[0].token_ids]
        runs.append((steps, ids))
    (s_steps, s_ids), (a_steps, a_ids) = runs
    assert a_ids == s_ids and len(s_ids) == 9
    assert a_steps[0] == [] and a_steps[1:] == s_steps


def test_step_n_tokens_reach_the_host_after_step_n_plus_1_is_launched(monkeypatch):
    """The order that overlaps host and device: forward N + 1, then step N's copy is read."""
    llm = LLM("tiny", async_scheduling=True, **KW)
    events: list[str] = []
    runner = llm.llm_engine.runner
    forward = runner._forward
    collect = async_tokens.DeferredTokens.collect

    def spied_forward(out):
        events.append("forward")
        return forward(out)

    def spied_collect(self):
        events.append("collect")
        return collect(self)

    monkeypatch.setattr(runner, "_forward", spied_forward)
    monkeypatch.setattr(async_tokens.DeferredTokens, "collect", spied_collect)
    llm.generate(["x = 1"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    # 4 forwards; each step's ids are read after the next forward, the last step's after
    # an empty one (the request's last token is pending, so nothing is scheduled)
    assert events == ["forward"] + ["forward", "collect"] * 4


def test_what_cannot_feed_from_the_device_is_refused():
    with pytest.raises(ValueError, match="speculative decoding"):
        spec = {"method": "ngram", "num_speculative_tokens": 2}
        EngineConfig.from_kwargs(async_scheduling=True, speculative_config=spec)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig.from_kwargs(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineConfig.from_kwargs(async_scheduling="yes")


@pytest.mark.parametrize("overlap", ["async_scheduling", "async_output_proc"])
def test_aborting_every_request_leaves_the_engine_idle_at_once(overlap):
    """The step in flight is taken when the last request is aborted: nothing unfinished, no
    block held, and the next request runs as on a fresh engine."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM("tiny", **KW).generate(["class C:"], params, use_tqdm=False)[0].outputs[0]
    engine = LLM("tiny", **{overlap: True}, **KW).llm_engine
    engine.add_request("a", "import sys", params)
    engine.add_request("b", "def g():", params)
    engine.step()
    engine.step()
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0
    engine.add_request("c", "class C:", params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in done] == [want.token_ids]


def test_logprobs_come_to_the_host_with_the_deferred_ids():
    """Sampled tokens' logprobs (top 0, 2, 5; seeded sampling; best_of ranking) are computed on
    the device and copied with the ids: the same values as the synchronous engine's, and the
    steps still defer."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=k)
              for k in (0, 2, 5)] + [
        SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=1.0, seed=2, n=2, best_of=3, max_tokens=6, ignore_eos=True),
    ]  # fmt: skip
    got, pipelined = same_outputs_both_ways(params)
    assert any(c.logprobs and len(c.logprobs[0]) > 1 for o in got for c in o.outputs)
    assert pipelined.llm_engine.runner.deferred_steps >= 8
