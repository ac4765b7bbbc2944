"""Structured outputs (guided decoding with xgrammar): JSON schema, regex, choice, grammar and
JSON-object outputs are valid by construction, with sampling, n > 1, ignore_eos and a
speculating engine; bad specs fail before any work."""

import json
import re

import pytest

from paged_llm import LLM, GuidedDecodingParams, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
PROMPTS = ["def main():", "import os", "class A:"]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", cpu_kv_cache_gib=0.02)


def texts(llm, guided, **kw):
    kw = {"temperature": 0.9, "seed": 0, "max_tokens": 48, **kw}
    sp = SamplingParams(guided_decoding=guided, **kw)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    return [c.text for o in outs for c in o.outputs]


def test_json_schema(llm):
    for temperature in (0.0, 0.9):
        for text in texts(llm, GuidedDecodingParams(json=SCHEMA), temperature=temperature):
            value = json.loads(text)
            assert list(value) == ["ok", "n", "tag"]  # the schema's order
            assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
            assert value["tag"] in ("red", "green")


def test_regex_choice_and_grammar(llm):
    for text in texts(llm, GuidedDecodingParams(regex=r"(yes|no)-[0-9]{2}")):
        assert re.fullmatch(r"(yes|no)-[0-9]{2}", text)
    choices = ["alpha", "beta gamma", "a.b*c"]
    assert set(texts(llm, GuidedDecodingParams(choice=choices))) <= set(choices)
    grammar = 'root ::= "x=" [0-9] ("+" [0-9])?'
    for text in texts(llm, GuidedDecodingParams(grammar=grammar)):
        assert re.fullmatch(r"x=[0-9](\+[0-9])?", text)


def test_json_object_starts_an_object(llm):
    for text in texts(llm, GuidedDecodingParams(json_object=True), max_tokens=400):
        assert isinstance(json.loads(text), dict)


def test_parallel_samples_and_ignore_eos_still_end_with_the_grammar(llm):
    guided = GuidedDecodingParams(regex=r"[a-c]{3}")
    outs = texts(llm, guided, n=3, ignore_eos=True)
    assert len(outs) == 3 * len(PROMPTS) and all(re.fullmatch(r"[a-c]{3}", t) for t in outs)
    assert len(set(outs)) > 1  # the samples are sampled independently


def test_guided_requests_decode_plainly_in_a_speculating_engine():
    llm = LLM("tiny", cpu_kv_cache_gib=0.02,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    guided = SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(
        json=SCHEMA))  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(["x = [1, 2, 1, 2, 1, 2", "def f():"], [plain, guided], use_tqdm=False)
    json.loads(outs[1].outputs[0].text)
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0  # the plain request speculated


@pytest.mark.parametrize(
    "kw,match",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "choice"),
    ],
)
def test_bad_params_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        GuidedDecodingParams(**kw)


def test_specs_that_do_not_compile_fail_before_work(llm, tiny_llama):
    bad = [GuidedDecodingParams(regex="(unclosed"), GuidedDecodingParams(grammar="root ::= ")]
    for guided in bad:
        with pytest.raises(ValueError, match="cannot compile"):
            llm.generate(["ok", "bad"], [SamplingParams(), SamplingParams(guided_decoding=guided)])
        assert not llm.llm_engine.has_unfinished_requests()
    no_tokenizer = LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="tokenizer"):
        no_tokenizer.generate(
            {"prompt_token_ids": [1, 2]},
            SamplingParams(guided_decoding=GuidedDecodingParams(regex="a")),
        )
