"""Stop strings end a request at the token that completes them, with or without speculation;
a stop token's text is left out of the output text, as in vLLM.

The reference decodes the whole output after every token and looks for stop strings that the
token newly completed (an occurrence not already in the previous text); the engine must return
exactly the tokens up to that one and the text cut there. Speculative decoding accepts several
tokens per step (the target as its own draft accepts all of them), which once let tokens after
the stop string into the output and let a stop on the last allowed token read as "length".
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm import LLM, SamplingParams
from paged_llm.engine.stop_strings import common_prefix_len
from paged_llm.sampling_params import RequestOutputKind

PROMPTS = ["def main():", "import os\n", "class A:\n    x = 1"]
MAX_TOKENS = 24
ENGINES = {
    "plain": {},
    "self-draft": {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module")
def engines():
    return {
        name: LLM("tiny", cpu_kv_cache_gib=0.01, speculative_config=spec or None)
        for name, spec in ENGINES.items()
    }


@pytest.fixture(scope="module")
def full_outputs(engines):
    """Each prompt's greedy output ids without stop strings (ignore_eos: exactly MAX_TOKENS)."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = engines["plain"].generate(PROMPTS, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def occurrences(text: str, stops: list[str]) -> set[tuple[int, str]]:
    """Every (position, stop string) in ``text``."""
    return {(i, s) for s in stops for i in range(len(text)) if text.startswith(s, i)}


def reference(tok, ids, stops, include, min_tokens, max_tokens):
    """(token ids, text, finish reason, stop reason) by decoding everything after each token."""
    before = ""
    for k in range(1, max_tokens + 1):
        text = tok.decode(ids[:k])
        new = occurrences(text, stops) - occurrences(before, stops)
        if k > min_tokens and new:
            at, stop = min(new)
            return ids[:k], text[: at + len(stop) if include else at], "stop", stop
        before = text
    return ids[:max_tokens], before, "length", None


def run_engine(llm, rid, prompt, params):
    """Concatenate a request's DELTA outputs: (token ids, text, finish reason, stop reason)."""
    engine = llm.llm_engine
    engine.add_request(rid, prompt, params)
    ids, text, finish, stop_reason = [], "", None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert finish is None, "nothing may follow the finish"
                ids += c.token_ids
                text += c.text
                finish, stop_reason = c.finish_reason, c.stop_reason
    return ids, text, finish, stop_reason


@st.composite
def stop_cases(draw):
    """A prompt, and stop strings cut out of its greedy text (plus ones it may not hold)."""
    prompt = draw(st.integers(0, len(PROMPTS) - 1))
    pieces = st.tuples(st.integers(0, 80), st.integers(1, 4))
    spans = draw(st.lists(pieces, min_size=1, max_size=3))
    extra = draw(st.lists(st.sampled_from(["\n", " ", "e", "):", "zzz"]), max_size=1))
    return prompt, spans, extra


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    case=stop_cases(),
    engine=st.sampled_from(list(ENGINES)),
    include=st.booleans(),
    min_tokens=st.integers(0, 6),
    max_tokens=st.integers(1, MAX_TOKENS),
    delta=st.booleans(),
)
def test_stop_strings_end_at_the_token_that_completes_them(
    engines, full_outputs, case, engine, include, min_tokens, max_tokens, delta
):
    prompt, spans, extra = case
    llm = engines[engine]
    tok = llm.get_tokenizer()
    ids = full_outputs[prompt]
    text = tok.decode(ids)
    stops = [text[i % len(text) :][:n] for i, n in spans] + extra
    stops = [s for s in dict.fromkeys(stops) if s]
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stops,
        include_stop_str_in_output=include, min_tokens=min(min_tokens, max_tokens),
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE,
    )  # fmt: skip
    want = reference(tok, ids, stops, include, params.min_tokens, max_tokens)
    if delta:
        got = run_engine(llm, "r", PROMPTS[prompt], params)
    else:
        c = llm.generate(PROMPTS[prompt], params, use_tqdm=False)[0].outputs[0]
        got = (c.token_ids, c.text, c.finish_reason, c.stop_reason)
    assert got == want
    assert llm.llm_engine.kv_usage() == 0


def test_a_stop_string_on_the_last_allowed_token_is_a_stop(engines, full_outputs):
    tok = engines["plain"].get_tokenizer()
    ids = full_outputs[0]
    # the first token whose text ends in a character seen nowhere before in the output
    k = next(
        k for k in range(2, len(ids)) if tok.decode(ids[:k])[-1] not in tok.decode(ids[: k - 1])
    )
    stop = tok.decode(ids[:k])[-1]
    params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, stop=[stop])
    for llm in engines.values():
        c = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (ids[:k], "stop", stop)
        assert c.text == tok.decode(ids[:k])[:-1]


def test_a_stop_tokens_text_is_left_out_as_in_vllm(engines, full_outputs):
    """EOS and stop_token_ids end the request with their id in token_ids but their text out of
    the text, unless include_stop_str_in_output; a stop string is not looked for in it."""
    tok = engines["plain"].get_tokenizer()
    ids = full_outputs[0]
    t = ids[3]
    k = ids.index(t) + 1
    for llm in engines.values():
        for include in (False, True):
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                    stop_token_ids=[t], stop=[tok.decode([t])],
                                    include_stop_str_in_output=include)  # fmt: skip
            c = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
            assert (c.token_ids, c.finish_reason, c.stop_reason) == (ids[:k], "stop", t)
            assert c.text == tok.decode(ids[:k] if include else ids[: k - 1])
    eos = tok.eos_token_id
    forced = dict(temperature=0, max_tokens=2, logit_bias={eos: 100.0}, skip_special_tokens=False)
    llm = engines["plain"]
    c = llm.generate(PROMPTS[0], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == ([eos], "", "stop", None)
    shown = SamplingParams(include_stop_str_in_output=True, **forced)
    assert llm.generate(PROMPTS[0], shown, use_tqdm=False)[0].outputs[0].text == "</s>"
    ignored = SamplingParams(ignore_eos=True, **forced)  # an ordinary token: its text stays
    assert llm.generate(PROMPTS[0], ignored, use_tqdm=False)[0].outputs[0].text == "</s>" * 2


def test_a_model_without_a_tokenizer_refuses_stop_strings(tiny_llama):
    llm = LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["a"]))
    out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


def test_common_prefix_len():
    assert common_prefix_len("abc", "abcd") == 3
    assert common_prefix_len("ab\ufffd", "ab€") == 2
    assert common_prefix_len("x ", "x.") == 1
    assert common_prefix_len("", "a") == common_prefix_len("a", "") == 0
