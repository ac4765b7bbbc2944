"""End-to-end engine tests: greedy parity with transformers, preemption, policies, bad input."""

import pytest
import torch

from paged_llm import LLM, GuidedDecodingParams, RequestOutputKind, SamplingParams
from paged_llm.engine.output_processor import IncrementalDetokenizer
from paged_llm.engine.token_texts import tokenizer_facts

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(5)]  # lengths 5..25


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,  # like ignore_eos: EOS is an ordinary token, not masked
        )
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def generate_ids(llm, prompts, n, **params):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    path, model = tiny_llama
    return [hf_greedy(model, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers_generate(tiny_llama, reference, block_size):
    llm = LLM(str(tiny_llama[0]), block_size=block_size, cpu_kv_cache_gib=0.01)
    assert generate_ids(llm, PROMPTS, 12) == reference


def test_greedy_opt_matches_transformers_generate(tiny_opt):
    path, model = tiny_opt
    llm = LLM(str(path), block_size=8, cpu_kv_cache_gib=0.01)
    assert generate_ids(llm, PROMPTS, 10) == [hf_greedy(model, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_identical_under_preemption(tiny_llama, reference, mode):
    # 20 blocks of 4 = 80 slots for 5 requests of up to 37 tokens: preemption is forced
    llm = LLM(
        str(tiny_llama[0]),
        block_size=4,
        num_gpu_blocks_override=64,
        max_model_len=64,
        preemption_mode=mode,
        swap_space=0.01,
    )
    assert generate_ids(llm, PROMPTS * 2, 12) == reference * 2
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_chunked_prefill_gives_identical_outputs(tiny_llama, reference):
    llm = LLM(
        str(tiny_llama[0]),
        block_size=4,
        max_model_len=64,
        enable_chunked_prefill=True,
        max_num_batched_tokens=7,
        cpu_kv_cache_gib=0.01,
    )
    assert generate_ids(llm, PROMPTS, 12) == reference


@pytest.mark.parametrize("policy", ["orca_max", "orca_pow2", "orca_oracle", "static"])
@pytest.mark.parametrize("backend", ["torch", "contiguous"])
def test_reservation_policies_give_identical_outputs(tiny_llama, reference, policy, backend):
    llm = LLM(
        str(tiny_llama[0]),
        block_size=4,
        max_model_len=64,
        num_gpu_blocks_override=64,
        policy=policy,
        attention_backend=backend,
    )
    assert generate_ids(llm, PROMPTS, 12) == reference


def test_contiguous_backend_rejects_paged_policy(tiny_llama):
    with pytest.raises(ValueError, match="contiguous"):
        LLM(str(tiny_llama[0]), attention_backend="contiguous", cpu_kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), max_model_len=64, cpu_kv_cache_gib=0.01)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ({"prompt_token_ids": []}, {}, "empty"),
        ({"prompt_token_ids": [1] * 64}, {}, "max_model_len"),
        ({"prompt_token_ids": [1, 999]}, {}, "vocabulary"),
        ({"prompt_token_ids": [1, -1]}, {}, "vocabulary"),
        ("some text", {}, "tokenizer"),
        ({"prompt_token_ids": [1, 2]}, {"logprobs": 10_000}, "vocabulary size"),
        ({"prompt_token_ids": [1, 2]}, {"prompt_logprobs": 257}, "vocabulary size"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, {}, "multi_modal_data"),
        ({"prompt_token_ids": [1, 2], "cache_salt": "a"}, {}, "cache_salt"),
    ],
)
def test_bad_prompts_raise_before_work(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [1, 2]}, prompt], SamplingParams(**params))
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "params,match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
        ({"stop": [5]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2.0}, "best_of"),
        ({"detokenize": False, "stop": ["x"]}, "detokenize"),
        ({"repetition_penalty": 10**400}, "repetition_penalty is too large"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"logit_bias": {1: 10**400}}, "logit_bias values is too large"),
    ],
)
def test_bad_sampling_params_raise(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)


@pytest.mark.parametrize(
    "params",
    [{"top_k": 2**64}, {"repetition_penalty": 2**64}, {"n": 2**64}, {"best_of": 2**40},
     {"top_k": 10**6, "temperature": 1.0}],
)  # fmt: skip
def test_huge_numbers_are_refused_or_served(llm, params):
    """Numbers far past any sensible range (a fuzzed server request): refused with a
    ValueError before any work, or served. (A top_k of 2**64 once passed the checks and then
    failed the engine's step, which stopped the server's engine loop for every request.)"""
    try:
        out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, **params))
    except ValueError as err:
        assert "max_num_seqs" in str(err)  # n / best_of: more sequences than ever run together
    else:
        assert len(out[0].outputs[0].token_ids) <= 3
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_engine_arguments_raise(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="unknown attention backend"):
        LLM(str(tiny_llama[0]), attention_backend="flash9", cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="unknown policy"):
        LLM(str(tiny_llama[0]), policy="lifo", cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(str(tiny_llama[0]), blok_size=3)
    with pytest.raises(ValueError, match="neither a local checkpoint"):
        LLM(str(tmp_path / "nope"))
    for kw, match in [({"block_size": 0}, "block_size"), ({"swap_space": -1}, "swap_space"),
                      ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                      ({"max_model_len": 0}, "max_model_len"),
                      ({"max_num_batched_tokens": 0}, "max_num_batched_tokens")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01, **kw)


def test_bad_request_does_not_disturb_running_ones(llm, reference):
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("good", {"prompt_token_ids": PROMPTS[0]}, sp)
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", {"prompt_token_ids": [10**6]}, sp)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": [1]}, sp)
    outs = [o for o in engine.iter_outputs() if o.finished]
    assert [o.request_id for o in outs] == ["good"]
    assert outs[0].outputs[0].token_ids == reference[0]


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[4]}, SamplingParams(max_tokens=30))
    engine.step()
    assert engine.kv_usage() > 0
    engine.abort_request("a")
    assert engine.kv_usage() == 0 and not engine.has_unfinished_requests()


def test_sampling_seed_is_reproducible_and_top_k_1_is_greedy(llm, reference):
    p = {"prompt_token_ids": PROMPTS[1]}
    a = llm.generate(p, SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    b = llm.generate(p, SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    k1 = llm.generate(p, SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True))
    assert k1[0].outputs[0].token_ids == reference[1]
    for top_p in (1e-6, 1e-300):  # 1e-300 is 0 in float32: the top token must still stay
        tiny_p = SamplingParams(temperature=0.8, top_p=top_p, max_tokens=12, ignore_eos=True)
        assert llm.generate(p, tiny_p)[0].outputs[0].token_ids == reference[1]


def test_stop_token_ids_max_tokens_and_logprobs(llm, reference):
    p = {"prompt_token_ids": PROMPTS[2]}
    stop = reference[2][3]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
    c = out[0].outputs[0]
    assert c.token_ids == reference[2][: reference[2].index(stop) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3 and len(c.logprobs) == 3
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and max(lp.values()) == lp[tok]  # greedy picks the most likely
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs))
    )


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, reference):
    """vLLM's left truncation: the same tokens as the prompt's tail alone; a prompt longer than
    max_model_len is accepted when the kept tail fits."""
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    tail = PROMPTS[2][-3:]
    long = [7] * 80 + tail  # 83 tokens > max_model_len 64
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": long}, {"prompt_token_ids": tail}],
        SamplingParams(truncate_prompt_tokens=3, **greedy),
    )
    assert [o.prompt_token_ids for o in outs] == [tail] * 3
    assert (
        outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    )
    short = llm.generate({"prompt_token_ids": tail}, SamplingParams(**greedy))[0]
    assert outs[0].outputs[0].token_ids == short.outputs[0].token_ids
    kept = llm.generate(
        {"prompt_token_ids": tail}, SamplingParams(truncate_prompt_tokens=50, **greedy)
    )
    assert kept[0].prompt_token_ids == tail  # shorter prompts are left alone


def test_engine_from_vllm_engine_args(tiny_llama, reference):
    from paged_llm import EngineArgs, LLMEngine

    path = str(tiny_llama[0])
    args = EngineArgs(model=path, max_model_len=64, cpu_kv_cache_gib=0.01)
    engine = LLMEngine.from_engine_args(args)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params)
    done = [o for o in engine.iter_outputs() if o.finished]
    assert done[0].outputs[0].token_ids == reference[0][:4]
    assert engine.get_tokenizer() is engine.tokenizer
    assert LLMEngine.from_engine_args(model=path, block_size=4).config.cache.block_size == 4
    with pytest.raises(ValueError, match="unknown engine argument 'max_model_length'"):
        EngineArgs(model=path, max_model_length=64)  # caught before any model is loaded
    with pytest.raises(ValueError, match="not both"):
        LLMEngine.from_engine_args(args, block_size=4)


def test_logprobs_are_vllm_logprob_objects():
    """Each entry maps token id -> Logprob(.logprob, .rank, .decoded_token), and is a float."""
    import json
    import pickle

    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=8, logprobs=3, prompt_logprobs=2)
    out = llm.generate("def main():", params)[0]
    c = out.outputs[0]
    rows = [(2, e) for e in out.prompt_logprobs[1:]] + [(3, e) for e in c.logprobs]
    chosen = out.prompt_token_ids[1:] + c.token_ids
    outside = 0
    for token, (k, entry) in zip(chosen, rows):
        for t, lp in entry.items():
            assert isinstance(lp, float) and lp.logprob == float(lp)
            assert lp.decoded_token == tokenizer.decode([t])
        ranked = sorted(entry.values(), key=lambda lp: -lp)
        assert ranked[0].rank == 1 and [lp.rank for lp in ranked] == sorted(
            lp.rank for lp in ranked
        )
        if len(entry) == k + 1:  # the chosen token is not among the top k: it ranks below them
            outside += 1
            assert entry[token].rank > k and ranked[-1] is entry[token]
        else:
            assert sorted(lp.rank for lp in entry.values()) == list(range(1, k + 1))
    assert outside > 0  # the sampled (temperature 1.5) and prompt tokens are often not top-k
    again = pickle.loads(pickle.dumps(c.logprobs))
    fields = [{t: (v.logprob, v.rank, v.decoded_token) for t, v in e.items()} for e in c.logprobs]
    assert [
        {t: (v.logprob, v.rank, v.decoded_token) for t, v in e.items()} for e in again
    ] == fields
    first = c.logprobs[0][c.token_ids[0]]
    assert json.loads(json.dumps(first)) == first.logprob


def test_each_request_of_a_batch_gets_its_own_number_of_logprobs():
    """The sampler builds every row's logprobs in one batched call: each row keeps its own k."""
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    ks = [0, 1, 3, 7, None]
    params = [SamplingParams(max_tokens=6, logprobs=k, temperature=0.8 * (i % 2), seed=i)
              for i, k in enumerate(ks)]  # fmt: skip
    prompts = ["def main():", "import os", "class A:", "x = 1", "print("]
    batch = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, got in zip(prompts, params, batch):
        want = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        got = got.outputs[0]
        assert got.token_ids == want.token_ids
        if p.logprobs is None:
            assert got.logprobs is None
            continue
        for token, g, w in zip(got.token_ids, got.logprobs, want.logprobs):
            assert len(g) in (p.logprobs, p.logprobs + 1) and token in g
            assert {t: lp.rank for t, lp in g.items()} == {t: lp.rank for t, lp in w.items()}
            assert all(abs(g[t] - w[t]) < 1e-4 for t in g)


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(llm):
    """vLLM V0's best_of: sample i uses seed + i either way, so best_of = 4, n = 2 must return
    the two of the n = 4 samples whose sampled tokens have the highest summed logprob."""
    prompt = {"prompt_token_ids": PROMPTS[2]}
    kw = dict(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    every = llm.generate(prompt, SamplingParams(n=4, logprobs=0, **kw), use_tqdm=False)[0]
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, **kw), use_tqdm=False)[0]
    ranked = sorted(every.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert len({tuple(c.token_ids) for c in every.outputs}) == 4  # the choice matters
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx(
        [c.cumulative_logprob for c in ranked]
    )
    assert best.outputs[0].logprobs is None  # ranked without reporting per-token logprobs
    plain = llm.generate(prompt, SamplingParams(n=2, **kw), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.kv_usage() == 0.0


def run_engine(engine, rid, prompt, params):
    """Every output step() returns for one request."""
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_output_kinds_delta_and_final_only_add_up_to_the_cumulative_output():
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    engine = llm.llm_engine
    kw = dict(max_tokens=24, logprobs=2, prompt_logprobs=1, n=3, seed=5, temperature=0.8)
    free = llm.generate("def main():", SamplingParams(**kw))[0].outputs[0].text
    kw["stop"] = [free[6:8], "zzz"]  # a stop string the first sample runs into
    cumulative = run_engine(engine, "c", "def main():", SamplingParams(**kw))
    want = cumulative[-1]
    kinds = RequestOutputKind
    final = run_engine(
        engine, "f", "def main():", SamplingParams(output_kind=kinds.FINAL_ONLY, **kw)
    )
    assert len(final) == 1 and final[0].finished
    assert [c.token_ids for c in final[0].outputs] == [c.token_ids for c in want.outputs]
    deltas = run_engine(engine, "d", "def main():", SamplingParams(output_kind=kinds.DELTA, **kw))
    assert len(deltas) == len(cumulative) and deltas[-1].finished
    assert deltas[0].prompt_logprobs == want.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for c in want.outputs:
        pieces = [p for d in deltas for p in d.outputs if p.index == c.index]
        assert "".join(p.text for p in pieces) == c.text
        assert [t for p in pieces for t in p.token_ids] == c.token_ids
        assert [e for p in pieces for e in p.logprobs] == c.logprobs
        assert [p.finish_reason for p in pieces].count(None) == len(pieces) - 1  # once, last
        assert pieces[-1].finish_reason == c.finish_reason
        assert all(p.token_ids or p.finish_reason for p in pieces)  # no empty updates
    assert any(c.finish_reason == "stop" for c in want.outputs)
    # LLM.generate reads only the end, whatever kind it is given
    full = llm.generate("def main():", SamplingParams(output_kind=kinds.DELTA, **kw))[0]
    assert [c.text for c in full.outputs] == [c.text for c in want.outputs]
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=2, output_kind=kinds.DELTA)


def test_default_model_generates_text_with_stop_strings():
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    first = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=16))[0]
    text = first.outputs[0].text
    assert isinstance(text, str) and first.outputs[0].token_ids
    stop = text[2:4] if len(text) > 4 else None
    if stop and stop.strip():
        out = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=16, stop=stop))
        assert out[0].outputs[0].finish_reason == "stop"
        assert stop not in out[0].outputs[0].text
    quiet = llm.generate(
        "def main():", SamplingParams(temperature=0, max_tokens=16, detokenize=False, logprobs=1)
    )[0].outputs[0]
    assert quiet.text == "" and quiet.token_ids == first.outputs[0].token_ids
    assert all(lp.decoded_token is None for entry in quiet.logprobs for lp in entry.values())


def test_sampling_params_clone_is_deep_but_shares_logits_processors():
    class Stateful:
        def __init__(self):
            self.table = list(range(1000))  # large state: shared, not copied

        def __call__(self, output_ids, logits):
            return logits

    class Clonable(Stateful):
        def clone(self):
            return Clonable()

    stateful, clonable = Stateful(), Clonable()
    p = SamplingParams(stop=["a"], logit_bias={3: 1.0}, logits_processors=[stateful, clonable])
    q = p.clone()
    plain = SamplingParams(stop=["a"], n=2, seed=3, guided_decoding=GuidedDecodingParams(regex="a"))
    assert plain.clone() == plain and plain.clone() is not plain
    q.stop.append("b")
    q.logit_bias[4] = 2.0
    assert p.stop == ["a"] and p.logit_bias == {3: 1.0}
    assert q.logits_processors[0] is stateful
    assert isinstance(q.logits_processors[1], Clonable) and q.logits_processors[1] is not clonable


def test_special_token_text_options():
    """vLLM's skip_special_tokens decides whether special tokens show in the text;
    spaces_between_special_tokens reaches the decode of tokenizers that use it (slow ones;
    fast ones ignore it, as in vLLM); extra_args rides along untouched."""
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    tok = llm.get_tokenizer()
    eos = "</s>"  # force it with a bias; ignore_eos keeps generating past it
    sp = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={tok.eos_token_id: 100.0})
    kept = llm.generate("def main():", SamplingParams(skip_special_tokens=False, **sp))[0]
    assert kept.outputs[0].text == eos * 3
    assert llm.generate("def main():", SamplingParams(**sp))[0].outputs[0].text == ""
    calls = []

    class SlowTokenizer:  # no backend_tokenizer: every step decodes the whole output
        def decode(self, ids, **kw):
            calls.append(kw)
            return tok.decode(ids, skip_special_tokens=kw["skip_special_tokens"])

    detok = IncrementalDetokenizer(SlowTokenizer(), False, False, tokenizer_facts(SlowTokenizer()))
    assert detok.update([5, 6]) == tok.decode([5, 6])
    assert calls == [{"skip_special_tokens": False, "spaces_between_special_tokens": False}]
    assert SamplingParams(extra_args={"tag": 1}).extra_args == {"tag": 1}
    for bad in (dict(spaces_between_special_tokens="no"), dict(extra_args=[1])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_chat_renders_the_template_and_generates_like_generate():
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    first = [{"role": "user", "content": "def add(a, b):"}]
    second = [{"role": "system", "content": "code"}, {"role": "user", "content": "import os"}]
    sp = SamplingParams(temperature=0, max_tokens=8)
    outs = llm.chat([first, second], sp, chat_template=template, use_tqdm=False)
    tok = llm.get_tokenizer()
    for conversation, out in zip([first, second], outs):
        text = tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        ids = tok.encode(text, add_special_tokens=False)
        want = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
        assert out.prompt == text and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(llm.chat(first, sp, chat_template=template, use_tqdm=False)) == 1
    own = tok.chat_template  # the built-in chat template (tokenizer_builder.CHAT_TEMPLATE)
    tok.chat_template = None
    with pytest.raises(ValueError, match="conversation 0: .*chat template"):
        llm.chat(first, sp)  # a tokenizer without a template of its own
    tok.chat_template = own
    # tools go to the template, as in vLLM's LLM.chat
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    with_tools = "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}" + template
    out = llm.chat(first, sp, chat_template=with_tools, tools=[tool], use_tqdm=False)[0]
    assert out.prompt.startswith("[lookup]<|user|>")
    assert llm.chat(first, sp, chat_template=with_tools, use_tqdm=False)[0].prompt == outs[0].prompt


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engine_runs(tiny_llama, reference, dtype):
    llm = LLM(str(tiny_llama[0]), dtype=dtype, cpu_kv_cache_gib=0.01, max_model_len=64)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    ids = generate_ids(llm, PROMPTS, 12)
    agree = sum(a == b for r, o in zip(reference, ids) for a, b in zip(r, o))
    assert agree >= 0.5 * 12 * len(PROMPTS)  # low precision may flip a few near-ties


def test_hydra_config_composes_and_rejects_typos():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from paged_llm.config import engine_config_from_dict

    configs = str(__import__("pathlib").Path(__file__).parents[1] / "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose("config", overrides=["policy=orca_pow2", "attention=torch"])
        ec = engine_config_from_dict(OmegaConf.to_container(cfg, resolve=True))
        assert ec.scheduler.policy["_target_"].endswith("OrcaPow2KVCacheManager")
        bad = compose("config", overrides=["+cache.blok_size=3"])
        with pytest.raises(ValueError, match="blok_size"):
            engine_config_from_dict(OmegaConf.to_container(bad, resolve=True))


def test_main_job_writes_results(tmp_path):
    from hydra import compose, initialize_config_dir

    from paged_llm.main import run

    configs = str(__import__("pathlib").Path(__file__).parents[1] / "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "job.num_throughput_requests=4",
                "job.sampling.max_tokens=4",
                "job.paper_figures=false",  # covered by the paper_repro tests
                "model=tiny",  # the trained default: tests/test_default_model.py
            ],
        )
    result = run(cfg, tmp_path)
    assert (tmp_path / "main.json").is_file()
    assert result["mode"] == "real" and result["throughput"]["output_tokens_per_s"] > 0
    assert len(result["samples"]) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 4])
def test_torch_backend_equals_reference(gqa, dtype):
    """Decodes (gathered into reused buffers), a prefill and a chunk after a prefix, against the
    einsum reference; the same backend then serves a step whose decodes need more blocks."""
    from paged_llm.attention.metadata import build_attention_metadata
    from paged_llm.attention.torch_backend import TorchAttentionBackend
    from paged_llm.ops.paged_attention.reference import paged_attention_reference

    torch.manual_seed(0)
    hkv, d, bs = 2, 16, 4
    k_cache = torch.randn(32, bs, hkv, d, dtype=dtype)
    v_cache = torch.randn(32, bs, hkv, d, dtype=dtype)
    perm = torch.randperm(32).tolist()
    backend = TorchAttentionBackend()
    steps = [
        ([1, 1, 5, 9], [7, 13, 5, 20], [perm[0:2], perm[2:6], perm[6:8], perm[8:13]]),
        ([1, 1], [30, 3], [perm[13:21], perm[21:22]]),  # a longer decode: the buffers grow
    ]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for q_lens, s_lens, tables in steps:
        meta = build_attention_metadata(q_lens, s_lens, tables, bs)
        t = sum(q_lens)
        q = torch.randn(t, hkv * gqa, d, dtype=dtype)
        k, v = torch.randn(t, hkv, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25)
        ref = paged_attention_reference(
            q, k_cache, v_cache, meta.block_tables, q_lens, s_lens, 0.25
        )
        torch.testing.assert_close(out, ref, **tol)


def test_metadata_any_order_matches_each_sequence_alone():
    """Prefills and decodes given interleaved run shortest first; ``out[back]`` returns each
    sequence's rows in the caller's order, equal to attention over that sequence alone."""
    from paged_llm.attention.metadata import build_attention_metadata
    from paged_llm.attention.torch_backend import TorchAttentionBackend
    from paged_llm.ops.paged_attention.reference import paged_attention_reference
    from paged_llm.spec.any_order import build_metadata_any_order

    torch.manual_seed(0)
    hkv, d, bs = 2, 16, 4
    k_cache, v_cache = torch.randn(32, bs, hkv, d), torch.randn(32, bs, hkv, d)
    perm = torch.randperm(32).tolist()
    q_lens, s_lens = [5, 1, 9, 1, 3], [5, 13, 20, 7, 11]
    tables = [perm[0:2], perm[2:6], perm[6:11], perm[11:13], perm[13:16]]
    meta, rows, back = build_metadata_any_order(q_lens, s_lens, tables, bs)
    assert meta.num_decodes == 2 and meta.query_lens_cpu == [1, 1, 3, 5, 9]
    t = sum(q_lens)
    q, k, v = torch.randn(t, hkv * 2, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    out = TorchAttentionBackend().forward(q[rows], k[rows], v[rows], k_cache, v_cache, meta, 0.25)
    out = out[back]
    start = 0
    for q_len, s_len, table in zip(q_lens, s_lens, tables):
        alone = build_attention_metadata([q_len], [s_len], [table], bs)
        ref = paged_attention_reference(
            q[start : start + q_len], k_cache, v_cache, alone.block_tables, [q_len], [s_len], 0.25
        )
        torch.testing.assert_close(out[start : start + q_len], ref, atol=1e-5, rtol=1e-5)
        start += q_len


def test_iteration_stats_stay_bounded(tiny_llama, monkeypatch):
    """A long-lived engine keeps at most MAX_ITERATION_STATS steps' statistics (newest kept)."""
    from paged_llm.engine import core

    monkeypatch.setattr(core, "MAX_ITERATION_STATS", 8)
    llm = LLM(str(tiny_llama[0]), seed=0, cpu_kv_cache_gib=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    stats = llm.llm_engine.iteration_stats
    assert 0 < len(stats) <= 8
    assert stats[-1].num_running == 1  # the last step's statistics are the newest kept


def test_tiny_temperature_is_greedy_instead_of_overflowing(llm, reference):
    sp = SamplingParams(temperature=1e-30, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_a_failed_generate_leaves_the_engine_empty(llm, reference, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=5))
    monkeypatch.undo()
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0
    assert generate_ids(llm, PROMPTS, 12) == reference


def test_vllm_prompt_types(llm):
    """paged_llm.inputs has vLLM's TokensPrompt / TextPrompt (plain dicts): the same outputs as
    the dict and list forms."""
    from paged_llm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3]), [1, 2, 3],
                         {"prompt_token_ids": [1, 2, 3]}], params)  # fmt: skip
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
