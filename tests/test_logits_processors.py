"""Per-request logits changes (user logits processors, min_tokens, logit_bias, repetition /
frequency / presence penalties): against a plain-Python reference, and end to end against
transformers."""

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm import LLM, SamplingParams
from paged_llm.runner.logits_processors import process_logits

VOCAB = 16
EOS = 2


def reference_row(logits, params, prompt, output, eos, bad_words=()):
    """One row, written out token by token from the definitions in vLLM's docs."""
    out = list(logits)
    if len(output) < params.min_tokens:
        for t in params.stop_token_ids + ([eos] if not params.ignore_eos else []):
            out[t] = -math.inf
    for word in bad_words:
        if len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1 :]) == tuple(
            word[:-1]
        ):
            out[word[-1]] = -math.inf
    if params.allowed_token_ids is not None:
        out = [v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(out)]
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    counts = Counter(output)
    for t in range(len(out)):
        r = params.repetition_penalty
        if t in counts or t in prompt:
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
    return out


tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    prompt=tokens.filter(bool),
    outputs=st.lists(tokens, min_size=1, max_size=4),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
    min_tokens=st.integers(0, 6),
    ignore_eos=st.booleans(),
    allowed=st.none() | st.sets(st.integers(0, VOCAB - 1), min_size=1).map(sorted),
    bad_words=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_matches_the_plain_python_reference(
    prompt, outputs, presence, frequency, repetition, bias, min_tokens, ignore_eos, allowed,
    bad_words, seed,
):  # fmt: skip
    params = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        logit_bias=bias, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=[7],
        max_tokens=None, allowed_token_ids=allowed,
    )  # fmt: skip
    logits = torch.randn(len(outputs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[0, 5] = -math.inf  # an already-masked token stays masked
    want = [reference_row(row.tolist(), params, prompt, out, EOS, bad_words) for row, out in
            zip(logits, outputs)]  # fmt: skip
    got = process_logits(logits.clone(), params, prompt, outputs, EOS, bad_words)
    assert torch.allclose(got, torch.tensor(want), atol=1e-4, rtol=1e-5)


@settings(max_examples=80, deadline=None)
@given(
    prompt=tokens.filter(bool),
    output=tokens.filter(bool),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.sampled_from([1.0, 0.5, 1.3]),
    min_tokens=st.integers(0, 14),
    bad_words=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_a_placeholder_counts_as_its_token_on_the_device(
    prompt, output, presence, frequency, repetition, min_tokens, bad_words, seed
):
    """Async scheduling samples before the last token reaches the host: the output ends in a
    placeholder and the token is passed on the device. The rows must equal those made from the
    whole output, exactly (penalties count it, bad words compare it)."""
    from paged_llm.core.request import PLACEHOLDER_TOKEN

    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition, min_tokens=min_tokens,
                            stop_token_ids=[7], max_tokens=None)  # fmt: skip
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    if bad_words and len(output) > 1:  # let a word end where the output does, sometimes
        bad_words = [*bad_words, [*output[-2:], (output[0] + 1) % VOCAB]]
    want = process_logits(logits.clone(), params, prompt, [output], EOS, bad_words)
    held = [*output[:-1], PLACEHOLDER_TOKEN]
    pending = torch.tensor([output[-1]])
    got = process_logits(logits.clone(), params, prompt, [held], EOS, bad_words, pending)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kw, words", [({"frequency_penalty": 0.5}, []),
                                       ({"bad_words": ["w"]}, [[3, 4, 9]])])  # fmt: skip
def test_a_placeholder_without_its_token_is_a_clear_error(kw, words):
    from paged_llm.core.request import PLACEHOLDER_TOKEN

    with pytest.raises(RuntimeError, match="placeholder"):
        process_logits(torch.zeros(1, VOCAB), SamplingParams(**kw), [1], [[3, PLACEHOLDER_TOKEN]],
                       EOS, words)  # fmt: skip


def test_rejects_mismatched_histories():
    with pytest.raises(ValueError, match="histories"):
        process_logits(torch.zeros(2, VOCAB), SamplingParams(), [1], [[]], EOS)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {3: 150}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"3": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_bad_values_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


# ---- the engine ---------------------------------------------------------------------------------
PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(4)]


def hf_greedy(model, prompt, n, params):
    """Greedy decoding with transformers' forward and the reference row processing."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            row = reference_row(logits, params, prompt, ids[len(prompt) :], eos=None)
            ids.append(max(range(len(row)), key=row.__getitem__))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)


def generate(llm, prompts, **kw):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_repetition_penalty_matches_transformers_generate(llm, tiny_llama):
    model = tiny_llama[1]
    want = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                 do_sample=False, repetition_penalty=1.8, pad_token_id=0,
                                 eos_token_id=None)  # fmt: skip
        want.append(out[0, len(p) :].tolist())
    assert generate(llm, PROMPTS, repetition_penalty=1.8) == want
    assert want != generate(llm, PROMPTS)  # the penalty changed something


@pytest.mark.parametrize(
    "kw",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0, "frequency_penalty": -0.5},
        {"repetition_penalty": 0.7, "presence_penalty": 0.8},
        {"logit_bias": {40: 4.0, 41: -100.0}, "frequency_penalty": 0.4},
    ],
)
def test_greedy_with_penalties_matches_a_transformers_loop(llm, tiny_llama, kw):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
    want = [hf_greedy(tiny_llama[1], p, 12, params) for p in PROMPTS]
    assert generate(llm, PROMPTS, **kw) == want


def test_batch_mixes_penalized_and_plain_requests(llm):
    """Each request's own parameters shape only its own row."""
    plain = generate(llm, PROMPTS)
    penalized = generate(llm, PROMPTS, frequency_penalty=2.0)
    params = [
        SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0 * (i % 2)
        )
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [penalized[i] if i % 2 else plain[i] for i in range(len(PROMPTS))]


def test_logit_bias_forces_a_token_when_sampling(llm):
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logit_bias={77: 100.0})
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [77] * 6


def test_min_tokens_holds_back_eos_even_when_biased_towards_it(llm):
    eos = llm.llm_engine.eos_token_id
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=4, logit_bias={eos: 100.0})
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert eos not in out.token_ids[:4] and len(out.token_ids) == 5


def test_logit_bias_outside_the_vocabulary_is_refused_before_work(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(
            [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}],
            [SamplingParams(), SamplingParams(logit_bias={10_000: 1.0})],
        )
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampled_with_penalties_is_seed_reproducible(llm):
    rnd = random.Random(0)
    prompts = [[rnd.randrange(256) for _ in range(6)] for _ in range(3)]
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=10, repetition_penalty=1.4,
                        presence_penalty=0.5)  # fmt: skip
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def test_allowed_token_ids_limit_what_is_sampled(llm):
    allowed = [11, 50, 99, 200]
    sp = SamplingParams(temperature=1.5, seed=0, max_tokens=20, allowed_token_ids=allowed,
                        ignore_eos=True)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    tokens = {t for o in outs for t in o.outputs[0].token_ids}
    assert tokens <= set(allowed) and len(tokens) > 1


def test_bad_words_never_appear():
    """With the default model's tokenizer: ban words the unconstrained greedy output uses."""
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    sp = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate("def main():", SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    words = sorted({w for w in free.text.split() if w.strip()}, key=len)[-2:]
    assert words
    out = llm.generate("def main():", SamplingParams(**sp, bad_words=words), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    for w in words:
        for text in (w, " " + w):
            seq = tok.encode(text, add_special_tokens=False)
            assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids)))
    assert ids != free.token_ids


def test_bad_words_and_allowed_ids_are_checked_before_work(llm):
    with pytest.raises(ValueError, match="tokenizer"):  # the tiny test model has none
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["x"]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(allowed_token_ids=[3, 999]))
    assert not llm.llm_engine.has_unfinished_requests()


def test_bans_that_leave_no_token_give_way_instead_of_failing_the_batch(llm):
    """allowed_token_ids=[EOS] while min_tokens bans EOS: the whitelist wins, so the request
    samples EOS (and, as min_tokens still holds off the stop, finishes after four of them)
    rather than sampling from nothing; the other request is unaffected."""
    eos = llm.llm_engine.eos_token_id
    conflicted = SamplingParams(temperature=1.0, seed=0, max_tokens=8, min_tokens=4,
                                allowed_token_ids=[eos])  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], [conflicted, plain],
                        use_tqdm=False)  # fmt: skip
    assert outs[0].outputs[0].token_ids == [eos] * 4
    assert outs[1].outputs[0].token_ids == generate(llm, PROMPTS[1:2])[0][:8]


# ---- user logits processors (vLLM's SamplingParams.logits_processors) ------------------------
def no_repeat(output_ids, logits):
    """Two-argument form: never the same token twice in a row."""
    if output_ids:
        logits[output_ids[-1]] = -math.inf
    return logits


def echo_prompt(prompt_ids, output_ids, logits):
    """Three-argument form: push towards the prompt token at the output's position (a new
    tensor, not the row changed in place)."""
    bonus = torch.zeros_like(logits)
    bonus[prompt_ids[len(output_ids) % len(prompt_ids)]] = 4.0
    return logits + bonus


def hf_greedy_with_processors(model, prompt, n, processors):
    """Greedy decoding with transformers' forward and the processors called by hand."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            out = ids[len(prompt) :]
            for fn in processors:
                logits = fn(list(prompt), out, logits) if fn is echo_prompt else fn(out, logits)
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_user_logits_processors_match_a_transformers_loop(llm, tiny_llama):
    processors = [echo_prompt, no_repeat]
    got = generate(llm, PROMPTS, logits_processors=processors)
    want = [hf_greedy_with_processors(tiny_llama[1], p, 12, processors) for p in PROMPTS]
    assert got == want
    assert got != generate(llm, PROMPTS)  # they did change something
    assert all(a != b for out in got for a, b in zip(out, out[1:]))


def test_user_logits_processors_see_each_sequences_own_history(llm):
    """With n = 3 samples each call gets its own sample's output ids (and copies of them)."""
    histories: list[list[int]] = []

    def record(output_ids, logits):
        histories.append(list(output_ids))
        output_ids.append(-1)  # a processor changing its argument changes nothing
        return logits

    sp = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True,
                        logits_processors=[record])  # fmt: skip
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, sp, use_tqdm=False)[0]
    for c in out.outputs:  # every prefix of every sample was passed exactly as generated
        for i in range(len(c.token_ids)):
            assert c.token_ids[:i] in histories
    assert len(histories) == sum(len(c.token_ids) for c in out.outputs)


@pytest.mark.parametrize(
    "processor,match",
    [
        (lambda logits: logits, "logits processor takes"),
        (lambda a, b, c, d: d, "logits processor takes"),
        ("not callable", "callables"),
    ],
)
def test_bad_logits_processors_are_refused_up_front(processor, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logits_processors=[processor])


@pytest.mark.parametrize(
    "result,match",
    [
        (lambda out, logits: logits[:-1], "must return a tensor of shape"),
        (lambda out, logits: logits.tolist(), "must return a tensor"),
        (lambda out, logits: logits * math.nan, "NaN"),
    ],
)
def test_a_broken_logits_processor_fails_its_generate_and_leaves_the_engine_clean(
    llm, result, match
):
    sp = SamplingParams(temperature=0, max_tokens=4, logits_processors=[result])
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], sp, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0.0
    assert generate(llm, PROMPTS[:2]) == generate(llm, PROMPTS[:2])  # still serves


def test_a_processor_that_masks_everything_gives_way(llm):
    """As for the built-in bans: a row left without any token falls back to the raw logits
    rather than sampling from nothing, and the batch goes on."""

    def mask_all(output_ids, logits):
        return torch.full_like(logits, -math.inf)

    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=4, ignore_eos=True,
                        logits_processors=[mask_all])  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                        [sp, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)],
                        use_tqdm=False)  # fmt: skip
    assert len(outs[0].outputs[0].token_ids) == 4
    assert outs[1].outputs[0].token_ids == generate(llm, PROMPTS[1:2])[0][:4]


# ---- any combination of settings: refused up front, or run without touching the batch -------
finite_or_odd = st.one_of(
    st.floats(-3, 3), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e9])
)
counts = st.one_of(st.integers(-2, 300), st.sampled_from([10**6, 2**64, 2.5]))


@settings(max_examples=40, deadline=None)
@given(
    kw=st.fixed_dictionaries(
        {},
        optional={
            "temperature": finite_or_odd,
            "top_p": finite_or_odd,
            "top_k": counts,
            "min_p": finite_or_odd,
            "max_tokens": counts,
            "min_tokens": counts,
            "seed": counts,
            "n": st.integers(-1, 3),
            "best_of": st.integers(-1, 5),
            "logprobs": counts,
            "prompt_logprobs": counts,
            "presence_penalty": finite_or_odd,
            "frequency_penalty": finite_or_odd,
            "repetition_penalty": finite_or_odd,
            "logit_bias": st.dictionaries(counts, finite_or_odd, max_size=3),
            "allowed_token_ids": st.lists(counts, max_size=3),
            "stop": st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=2),
            "stop_token_ids": st.lists(counts, max_size=2),
            "ignore_eos": st.booleans(),
        },
    )
)
def test_any_settings_are_refused_up_front_or_leave_other_requests_alone(llm, kw):
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = generate(llm, PROMPTS[:1])[0][:6]
    try:
        params = SamplingParams(**kw)
    except ValueError:
        return
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[0]}],
                            [params, good], use_tqdm=False)  # fmt: skip
    except ValueError:
        assert not llm.llm_engine.has_unfinished_requests()
        return
    assert outs[1].outputs[0].token_ids == want
