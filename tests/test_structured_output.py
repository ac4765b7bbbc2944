"""Structured outputs (guided decoding with xgrammar): JSON schema, regex, choice, grammar and
JSON-object outputs are valid by construction, with sampling, n > 1, ignore_eos and a
speculating engine; bad specs fail before any work."""

import json
import re

import pytest

from paged_llm import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

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


def test_a_grammar_that_completes_before_min_tokens_ends_the_request(llm):
    guided = GuidedDecodingParams(choice=["yes", "no"])
    for ignore_eos in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, ignore_eos=ignore_eos,
                            guided_decoding=guided)  # fmt: skip
        out = llm.generate("ok?", sp, use_tqdm=False)[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_parallel_samples_and_ignore_eos_still_end_with_the_grammar(llm):
    guided = GuidedDecodingParams(regex=r"[a-c]{3}")
    outs = texts(llm, guided, n=3, ignore_eos=True)
    assert len(outs) == 3 * len(PROMPTS) and all(re.fullmatch(r"[a-c]{3}", t) for t in outs)
    assert len(set(outs)) > 1  # the samples are sampled independently


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller random model on the tiny model's tokenizer (a poor but valid draft)."""
    import shutil

    import torch
    import transformers as tf

    from paged_llm.models.presets import default_model_dir

    src = default_model_dir()
    cfg = tf.AutoConfig.from_pretrained(str(src))
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 1, 64, 128
    cfg.num_attention_heads, cfg.num_key_value_heads = 2, 1
    cfg.head_dim = 32
    out = tmp_path_factory.mktemp("draft")
    torch.manual_seed(3)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(out))
    for f in src.glob("*token*"):
        shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model", "self"])
def test_speculation_keeps_guided_greedy_outputs(llm, draft_dir, method):
    """Drafts are cut where the grammar rejects them and each verified row is masked by the
    grammar after the drafts before it: the same output as without drafts."""
    from paged_llm.models.presets import default_model_dir

    spec = {"method": "draft_model" if method != "ngram" else "ngram",
            "num_speculative_tokens": 3}  # fmt: skip
    if method != "ngram":
        spec["model"] = str(draft_dir if method == "draft_model" else default_model_dir())
    specd = LLM("tiny", cpu_kv_cache_gib=0.02, speculative_config=spec)
    prompts = ["x = [1, 2, 1, 2, 1, 2", "def f():", '{"ok": true, "n": 1']
    for guided in [GuidedDecodingParams(json=SCHEMA), GuidedDecodingParams(regex=r"(ab|ba){6}")]:
        for ignore_eos in (False, True):
            sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=ignore_eos,
                                guided_decoding=guided)  # fmt: skip
            want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            got = [o.outputs[0].token_ids for o in specd.generate(prompts, sp, use_tqdm=False)]
            assert got == want
    stats = specd.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0
    if method == "self":  # the target drafting for itself under the same grammar
        assert stats.acceptance_rate == 1.0


def test_sampled_guided_speculation_stays_inside_the_grammar(draft_dir):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft_dir)}
    specd = LLM("tiny", cpu_kv_cache_gib=0.02, speculative_config=spec)
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=48, n=4,
                        guided_decoding=GuidedDecodingParams(json=SCHEMA))  # fmt: skip
    outs = specd.generate(PROMPTS, sp, use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop" and json.loads(c.text)["tag"] in ("red", "green")
    assert specd.llm_engine.spec_stats.num_accepted_tokens > 0


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


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_guided_outputs_survive_preemption(llm, mode):
    """Recomputation or swapping moves a sequence's KV, not its grammar state."""
    import logging

    small = LLM("tiny", block_size=4, max_model_len=32, num_gpu_blocks_override=12,
                preemption_mode=mode, swap_space=0.01)  # fmt: skip
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    sp = SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(
        regex=r"([a-z]{1,4} ){3}[0-9]{2}"))  # fmt: skip
    prompts = [f"# item {i}\n" for i in range(12)]
    want = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].text for o in small.generate(prompts, sp, use_tqdm=False)]
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    assert got == want and all(re.fullmatch(r"([a-z]{1,4} ){3}[0-9]{2}", t) for t in got)


def test_conflicting_whitelists_never_fail_the_batch(llm):
    """allowed_token_ids that exclude every first token of the grammar: refused at once. One that
    conflicts only later: the grammar wins there (the output stays well-formed), and the other
    requests of the batch are untouched."""
    (a,) = llm.get_tokenizer().encode("a", add_special_tokens=False)
    (x,) = llm.get_tokenizer().encode("x", add_special_tokens=False)
    with pytest.raises(ValueError, match="leave no token to start with"):
        llm.generate("q", SamplingParams(guided_decoding=GuidedDecodingParams(regex="[ab]{2}"),
                                         allowed_token_ids=[x]))  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], plain, use_tqdm=False)[0].outputs[0].token_ids
    regex = GuidedDecodingParams(regex="ab")
    guided = SamplingParams(guided_decoding=regex, allowed_token_ids=[a], seed=0, max_tokens=8)
    outs = llm.generate(PROMPTS[:2], [plain, guided], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    assert outs[1].outputs[0].text == "ab" and outs[1].outputs[0].finish_reason == "stop"


def test_vllm_current_names_structured_outputs(llm):
    """vLLM >= 0.12 spells it SamplingParams(structured_outputs=StructuredOutputsParams(...));
    the older guided_decoding / GuidedDecodingParams name the same objects."""
    assert GuidedDecodingParams is StructuredOutputsParams
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(structured_outputs=choice, temperature=0.9, seed=0, max_tokens=8)
    assert params.guided_decoding is choice and params.clone().structured_outputs is not None
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert {o.outputs[0].text for o in outs} <= {"yes", "no"}
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(
            structured_outputs=choice, guided_decoding=StructuredOutputsParams(regex="a")
        )
