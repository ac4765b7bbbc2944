"""Random mixes of every sampling option in one batch (grammars, whitelists, bans, penalties,
stops, logprobs, n, best_of, truncation, user logits processors), on engines that chunk, cache
prefixes, speculate (n-grams, a draft model), preempt, or reserve buddy runs (Orca, static): a
request is either refused when added (ValueError) or finishes, and never fails the batch it runs
in. (A grammar that excluded every allowed token once stopped the engine this way.) Then random
add / step / abort interleavings and beam searches on random engine configurations."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm import LLM, BeamSearchParams, GuidedDecodingParams, SamplingParams

ENGINES = {
    "chunked+prefix": dict(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=16,
                           enable_prefix_caching=True, cpu_kv_cache_gib=0.02),
    "recompute+chunked+prefix": dict(block_size=4, num_gpu_blocks_override=24, max_model_len=96,
                                     preemption_mode="recompute", enable_chunked_prefill=True,
                                     max_num_batched_tokens=16, enable_prefix_caching=True),
    "ngram+swap": dict(block_size=4, num_gpu_blocks_override=24, max_model_len=96,
                       preemption_mode="swap", max_num_seqs=3,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    "draft+prefix": dict(block_size=4, num_gpu_blocks_override=24, max_model_len=96,
                         enable_prefix_caching=True,
                         speculative_config={"method": "draft_model", "model": "tiny",
                                             "num_speculative_tokens": 2}),
    # a 27-block pool is buddy runs of 16 + 8 + 2 + 1: groups whose runs cannot pack are refused
    "orca_pow2+chunked": dict(block_size=4, num_gpu_blocks_override=27, max_model_len=64,
                              policy="orca_pow2", enable_chunked_prefill=True,
                              max_num_batched_tokens=5, max_num_seqs=4),
    "static+fp8_kv": dict(block_size=2, num_gpu_blocks_override=40, max_model_len=48,
                          policy="static", max_num_seqs=3, kv_cache_dtype="fp8"),
}  # fmt: skip
GRAMMARS = [
    GuidedDecodingParams(regex="[ab]{2}"),
    GuidedDecodingParams(choice=["yes", "no"]),
    GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    GuidedDecodingParams(grammar='root ::= "x" [0-9]'),
]
PROMPTS = ["def f(x):", "import os\n", "a", "class A:\n    x = 1"]
VOCAB = 512  # ids beyond the tiny model's vocabulary are refused, which is part of the test


def _no_repeat(output_ids, logits):
    if output_ids:
        logits[output_ids[-1]] = float("-inf")
    return logits


def _favour_a(prompt_ids, output_ids, logits):
    logits[prompt_ids[0]] += 5.0
    return logits


_params = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 10)},
    optional={
        "n": st.integers(1, 3),
        "best_of": st.integers(1, 4),
        "temperature": st.sampled_from([0.0, 1e-6, 0.7, 1.0, 50.0]),
        "top_p": st.sampled_from([1.0, 0.5, 1e-6]),
        "top_k": st.sampled_from([-1, 1, 5]),
        "min_p": st.sampled_from([0.0, 0.5, 1.0]),
        "min_tokens": st.integers(0, 3),
        "seed": st.integers(0, 5),
        "presence_penalty": st.sampled_from([2.0, -2.0]),
        "repetition_penalty": st.sampled_from([1e-3, 50.0]),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB), st.sampled_from([-100.0, 100.0]),
                                      max_size=3),
        "allowed_token_ids": st.lists(st.integers(0, VOCAB), min_size=1, max_size=3),
        "bad_words": st.lists(st.sampled_from(["a", "def", " x", "\n"]), max_size=2),
        "stop": st.lists(st.sampled_from(["a", "\n", "):"]), max_size=2),
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, 3),
        "prompt_logprobs": st.integers(0, 2),
        "truncate_prompt_tokens": st.integers(1, 5),
        "guided_decoding": st.sampled_from(GRAMMARS),
        "logits_processors": st.sampled_from([[_no_repeat], [_favour_a]]),
        "detokenize": st.booleans(),
    },
)  # fmt: skip


@pytest.fixture(scope="module", params=list(ENGINES))
def llm(request):
    return LLM("tiny", **ENGINES[request.param])


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(_params, min_size=1, max_size=4))
def test_a_batch_of_random_requests_finishes(llm, batch):
    accepted = []
    for prompt, kw in zip(PROMPTS, batch):
        try:
            params = SamplingParams(**kw)
            llm.generate(prompt, params, use_tqdm=False)  # alone first: refused or finishes
        except ValueError:
            continue
        accepted.append((prompt, params))
    if accepted:
        outs = llm.generate([p for p, _ in accepted], [s for _, s in accepted], use_tqdm=False)
        for out, (_, params) in zip(outs, accepted):
            assert out.finished and len(out.outputs) == params.n
            assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0  # no block leaked


# ---- random interleavings of add / step / abort on the engine itself -------------------------
_add = st.tuples(
    st.just("add"),
    st.integers(0, len(PROMPTS) - 1),
    st.integers(1, 24),
    st.sampled_from([None, 0, 1]),
    st.integers(1, 3),
    st.integers(0, 1),
)
_ops = st.lists(
    st.one_of(_add, _add, st.tuples(st.just("step"), st.integers(1, 4)),
              st.tuples(st.just("abort"), st.integers(0, 20))),
    min_size=6,
    max_size=30,
)  # fmt: skip


def _params_of(max_tokens, seed, n, extra_best):
    """Greedy when seed is None (n samples of it are all the same), else seeded sampling."""
    if seed is None:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          n=n, best_of=n + extra_best)  # fmt: skip


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=_ops)
def test_random_add_step_abort_interleavings(llm, ops):
    """Requests arrive, run a few steps, and are aborted at random moments (waiting, mid-chunk,
    before their samples fork, swapped out, mid-speculation). No block leaks, every request
    not aborted finishes with its n outputs, and a greedy one gets exactly the tokens it gets
    when it runs alone."""
    run_interleaving(llm, ops)


@st.composite
def engine_configs(draw):
    """Any engine the LLM constructor accepts over the tiny model: block size, pool size, token
    budget, sequence limit, policy, queue order (FCFS or priority), preemption, prefix caching
    (with or without a CPU tier), KV dtype, attention backend
    (the CPU default, torch, contiguous), weight quantization, model dtype, speculation,
    async output processing, async scheduling."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.sampled_from([48, 64, 96]))
    policy = draw(st.sampled_from(["paged", "paged", "orca_max", "orca_pow2", "orca_oracle",
                                   "static"]))  # fmt: skip
    cfg = dict(
        block_size=block_size, max_model_len=max_model_len, policy=policy,
        num_gpu_blocks_override=-(-max_model_len // block_size) + draw(st.integers(0, 32)),
        max_num_seqs=draw(st.sampled_from([1, 2, 3, 8, 256])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "fcfs", "priority"])),
    )  # fmt: skip
    if draw(st.booleans()):
        cfg.update(enable_chunked_prefill=True,
                   max_num_batched_tokens=draw(st.sampled_from([1, 2, 5, 16, 64])))  # fmt: skip
    if policy == "paged":
        cfg["preemption_mode"] = draw(st.sampled_from(["recompute", "swap"]))
        cfg["swap_space"] = draw(st.sampled_from([1.0, 0.0001]))  # 0.0001 GiB: swap space runs out
        cfg["enable_prefix_caching"] = draw(st.booleans())
        if cfg["enable_prefix_caching"]:  # a CPU tier of 0, ~6 or ~60 tiny-model blocks
            cfg["kv_offloading_size"] = draw(st.sampled_from([0.0, 0.0001, 0.001]))
    cfg["kv_cache_dtype"] = draw(st.sampled_from(["auto", "auto", "int8", "fp8"]))
    backends = ["auto", "torch"] + (["contiguous"] if policy != "paged" else [])
    cfg["attention_backend"] = draw(st.sampled_from(backends))
    cfg["quantization"] = draw(st.sampled_from([None, None, "int8", "fp8", "int4_rtn"]))
    cfg["dtype"] = draw(st.sampled_from(["float32", "float32", "float32", "bfloat16"]))
    cfg["async_output_proc"] = draw(st.booleans())  # outputs a step later, the same tokens
    method = draw(st.sampled_from([None, None, "ngram", "draft_model"]))
    if not method:  # plans step N + 1 before N's tokens are on the host; the same tokens
        cfg["async_scheduling"] = draw(st.booleans())
    if method:
        k = draw(st.integers(1, 4))
        cfg["speculative_config"] = {"method": method, "num_speculative_tokens": k}
        if method == "draft_model":
            cfg["speculative_config"]["model"] = "tiny"
    return cfg


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(cfg=engine_configs(), ops=_ops)
def test_random_engine_configurations(default_llm, cfg, ops):
    """The same interleavings on a random engine: a configuration is refused when built
    (ValueError) or serves every request (this found Orca accepting requests that waited
    forever for a buddy run a 48-block pool does not have). With float32 weights and KV, greedy
    requests, and seeded ones without speculation, get exactly what the default engine gives
    them: paging, policies, chunking, caching and preemption change no token. (Quantized
    weights or KV change the model; bfloat16 changes which near-tie wins.)"""
    try:
        llm = LLM("tiny", **cfg)
    except ValueError:
        return
    fp32 = cfg["dtype"] == "float32"
    exact = fp32 and cfg["kv_cache_dtype"] == "auto" and cfg["quantization"] is None
    run_interleaving(llm, ops, reference=default_llm if exact else None, exact_alone=fp32)


@pytest.fixture(scope="module")
def default_llm():
    return LLM("tiny", max_model_len=96)


def run_interleaving(llm, ops, reference=None, exact_alone=True):
    """Apply add / step / abort ops to the engine, drain it, and check what every test of
    this kind checks (see test_random_add_step_abort_interleavings); with ``reference``, also
    that the outputs it must reproduce exactly are its outputs. ``exact_alone=False`` skips
    the greedy-alone comparison: in bfloat16 / float16 a batch's GEMM shapes move the logits
    of a random model's near-ties (0.004 apart) enough to flip a greedy token."""
    engine = llm.llm_engine
    added, aborted, final = {}, set(), {}

    def run(steps):
        for _ in range(steps):
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out

    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, seed, n, extra_best = op
            rid = f"r{len(added)}"
            params = _params_of(max_tokens, seed, n, extra_best)
            # under priority scheduling, some order that is not the arrival order
            priority = (prompt + max_tokens) % 3 if engine.scheduler.queue.orders_by_priority else 0
            # refused: a group too large for the pool or for max_num_seqs (it would preempt
            # itself forever)
            try:
                engine.add_request(rid, PROMPTS[prompt], params, priority=priority)
            except ValueError as err:
                assert "KV blocks together" in str(err) or "max_num_seqs" in str(err)
                continue
            added[rid] = (PROMPTS[prompt], params)
        elif op[0] == "step":
            run(op[1])
        else:
            live = [rid for rid in added if rid not in final and rid not in aborted]
            if live:
                rid = live[op[1] % len(live)]
                engine.abort_request(rid)
                aborted.add(rid)
    for _ in range(2000):  # a livelock fails here instead of hanging the suite
        if not engine.has_unfinished_requests():
            break
        run(1)
    else:
        for rid in list(added):  # leave the shared engine empty for the next example
            engine.abort_request(rid)
        raise AssertionError(f"requests still unfinished after 2000 steps: {ops}")
    assert engine.kv_usage() == 0 and engine.scheduler.kv.num_free_blocks() == engine.num_kv_blocks
    assert set(final) == set(added) - aborted
    for rid, out in final.items():
        prompt, params = added[rid]
        assert len(out.outputs) == params.n
        assert all(len(c.token_ids) == params.max_tokens for c in out.outputs)
        got = [c.token_ids for c in out.outputs]
        if params.greedy and exact_alone:
            alone = llm.generate(prompt, params, use_tqdm=False)[0]
            assert got == [c.token_ids for c in alone.outputs]
        # speculation samples from the target's distribution, but not the same draws
        if reference is not None and (params.greedy or engine.drafter is None):
            want = reference.generate(prompt, params, use_tqdm=False)[0]
            assert got == [c.token_ids for c in want.outputs]


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    cfg=engine_configs().filter(lambda c: c["policy"] == "paged"),
    width=st.integers(1, 5),
    max_tokens=st.integers(1, 20),
    prompts=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=3),
    length_penalty=st.sampled_from([0.0, 1.0, 2.0]),
    ignore_eos=st.booleans(),
)
def test_beam_search_on_random_engines(default_llm, cfg, width, max_tokens, prompts,
                                       length_penalty, ignore_eos):  # fmt: skip
    """Beam search forks and drops block tables on any paged engine (small pools that preempt
    by recompute or swap, chunked prefill, prefix caching, any block size) and finds exactly
    the beams the default engine finds, leaving no block behind."""
    cfg = {**cfg, "kv_cache_dtype": "auto", "quantization": None, "dtype": "float32"}
    cfg.pop("speculative_config", None)  # refused by beam search (its own test)
    try:
        llm = LLM("tiny", **cfg)
    except ValueError:
        return
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty, ignore_eos=ignore_eos)  # fmt: skip
    batch = [PROMPTS[i] for i in prompts]
    try:
        got = llm.beam_search(batch, params)
    except ValueError as err:  # more beams than max_num_seqs, or than the pool holds
        assert "beam_width" in str(err)
        return
    want = default_llm.beam_search(batch, params)
    assert [[s.tokens for s in o.sequences] for o in got] == [
        [s.tokens for s in o.sequences] for o in want
    ]
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0
