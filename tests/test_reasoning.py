"""Reasoning parsers: the thought split off a reply (whole and streamed alike), grammars that wait
for the end of the thought (offline, with speculation, and through the server), and the
checks. The model is a tiny random Llama whose tokenizer has <think> and </think> as tokens;
logits processors script when it opens and closes its thought."""

import json
import re

import httpx
import openai
import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm import LLM, SamplingParams, StructuredOutputsParams
from paged_llm.engine.reasoning import AfterReasoning, reasoning_parser
from paged_llm.models.presets import default_model_dir
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser
from paged_llm.serve.replies import ChatReply
from paged_llm.serve.tool_calls import AutoToolCalls, HermesToolParser

R1, QWEN3 = reasoning_parser("deepseek_r1"), reasoning_parser("qwen3")
# deepseek-r1 style: the template opens the thought for the model
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}"
)
DIGITS = StructuredOutputsParams(regex="[0-9]{3}")


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    """The tiny model's tokenizer plus <think> and </think> (ids 2048, 2049), on a random model
    with a vocabulary of 2050."""
    src = default_model_dir()
    out = tmp_path_factory.mktemp("thinker")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(src))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(out))
    cfg = tf.AutoConfig.from_pretrained(str(src))
    cfg.vocab_size = len(tokenizer)
    torch.manual_seed(5)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tags(thinker_dir):
    return R1.tag_ids(tf.AutoTokenizer.from_pretrained(str(thinker_dir)))


def forcing(schedule):
    """A logits processor that forces token ``schedule[i]`` as the i-th output token."""

    def force(output_ids, logits):
        token = schedule.get(len(output_ids))
        if token is not None:
            keep = logits[token].clone()
            logits.fill_(float("-inf"))
            logits[token] = keep
        return logits

    return force


# ---- splitting ----------------------------------------------------------------------------
def test_split_r1_and_qwen3():
    assert R1.split("plan</think>answer", True) == ("plan", "answer")
    assert R1.split("<think>plan</think>answer", True) == ("plan", "answer")
    assert R1.split("still thinking", True) == ("still thinking", "")  # no end: all thought
    assert R1.split("plan</thi", False) == ("plan", "")  # the tag may be coming
    assert QWEN3.split("<think>plan</think>\n\nanswer", True) == ("plan", "\n\nanswer")
    assert QWEN3.split("answer only", True) == ("", "answer only")  # thinking turned off
    assert QWEN3.split("<thi", False) == ("", "") and QWEN3.split("<thi", True) == ("", "<thi")
    assert QWEN3.split("<think>cut short", True) == ("cut short", "")
    with pytest.raises(ValueError, match="known: \\['deepseek_r1', 'qwen3'\\]"):
        reasoning_parser("o1")


def test_tool_calls_are_found_after_the_thought():
    reply = ChatReply(R1, AutoToolCalls(HermesToolParser()))
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    # a call inside the thought is only thought; the one after it is a call
    message, finish = reply.message(f"maybe {call}?</think>Sure. {call}", "stop")
    assert message["reasoning"] == f"maybe {call}?" and message["content"] == "Sure. "
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    assert finish == "tool_calls"


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "ab", " ", "\n"]),
        max_size=8,
    ),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    parser=st.sampled_from(["deepseek_r1", "qwen3"]),
)
def test_a_streamed_thought_adds_up_to_the_whole_reply(pieces, cuts, parser):
    text = "".join(pieces)
    reply = ChatReply(reasoning_parser(parser), None)
    whole, _ = reply.message(text, "stop")
    stream = reply.stream()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    thought, content = "", ""
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:] + [len(text)])):
        delta = stream.feed(text[lo:hi], finished=i == len(bounds) - 1)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        thought += delta.get("reasoning") or ""
        content += delta.get("content", "")
    assert thought == (whole["reasoning"] or "") and content == (whole["content"] or "")


# ---- the grammar gate -----------------------------------------------------------------------
class FakeGuide:
    """A grammar that allows only token 7 and completes after two of them."""

    vocab_size = 10

    def __init__(self):
        self.seen = []

    def allowed(self, pending=()):
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[7] = len(self.seen) + len(pending) < 2
        return mask

    def valid_prefix(self, tokens):
        n = 0
        while n < len(tokens) and tokens[n] == 7 and len(self.seen) + n < 2:
            n += 1
        return n

    def accept(self, token):
        assert token == 7
        self.seen.append(token)

    def is_terminated(self):
        return len(self.seen) == 2


def test_gate_states_follow_the_prompt_and_the_tags():
    start, end = 8, 9
    gate = R1.gate(FakeGuide(), [1, 2, start], (start, end))  # the prompt opened the thought
    assert gate.state == AfterReasoning.THINKING and bool(gate.allowed().all())
    assert gate.valid_prefix([3, 4, end, 7, 7, 7]) == 5  # the third 7 breaks the grammar
    assert gate.allowed([3, end, 7]).nonzero().flatten().tolist() == [7]
    for token in (3, 4, end):
        gate.accept(token)
    assert gate.guide.seen == [] and gate.state == AfterReasoning.ANSWERING
    gate.accept(7)
    gate.accept(7)
    assert gate.is_terminated()
    closed = QWEN3.gate(FakeGuide(), [start, end, 1], (start, end))  # thinking turned off
    assert closed.state == AfterReasoning.ANSWERING
    assert closed.allowed().nonzero().flatten().tolist() == [7]
    undecided = QWEN3.gate(FakeGuide(), [1], (start, end))
    assert undecided.allowed().nonzero().flatten().tolist() == [7, start]
    assert undecided.valid_prefix([start, 3, end, 7]) == 4
    assert undecided.valid_prefix([7, start]) == 1  # answered at once: no thought after
    assert R1.gate(FakeGuide(), [1], (start, end)).state == AfterReasoning.THINKING


def test_offline_grammar_waits_for_the_thought(thinker_dir, tags):
    start, end = tags
    llm = LLM(str(thinker_dir), cpu_kv_cache_gib=0.02, reasoning_parser="deepseek_r1")
    tokenizer = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=20, structured_outputs=DIGITS,
                        logits_processors=[forcing({4: end})])  # fmt: skip
    prompt = {"prompt_token_ids": tokenizer.encode("Q? <think>", add_special_tokens=False)}
    out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[4] == end and out.finish_reason == "stop"  # the grammar completed
    thought, answer = R1.split(out.text, finished=True)
    assert re.fullmatch("[0-9]{3}", answer) and not re.fullmatch("[0-9]*", thought)
    # without guided decoding the parser changes nothing
    plain = SamplingParams(temperature=0, max_tokens=12)
    base = LLM(str(thinker_dir), cpu_kv_cache_gib=0.02)
    assert (llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
            == base.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids)  # fmt: skip
    # speculation (n-grams) cuts drafts by the gated grammar: the same greedy output
    specd = LLM(str(thinker_dir), cpu_kv_cache_gib=0.02, reasoning_parser="deepseek_r1",
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    repeat = {"prompt_token_ids": prompt["prompt_token_ids"] * 3}
    for p in (prompt, repeat):
        want = llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
        assert specd.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == want


def test_qwen3_thinks_only_when_it_opens_with_the_tag(thinker_dir, tags):
    start, end = tags
    llm = LLM(str(thinker_dir), cpu_kv_cache_gib=0.02, reasoning_parser="qwen3")
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("Q?", add_special_tokens=False)}
    thinking = SamplingParams(temperature=0, max_tokens=20, structured_outputs=DIGITS,
                              logits_processors=[forcing({0: start, 3: end})])  # fmt: skip
    out = llm.generate(prompt, thinking, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == start and out.token_ids[3] == end
    assert re.fullmatch("[0-9]{3}", QWEN3.split(out.text, finished=True)[1])
    direct = SamplingParams(temperature=0, max_tokens=20, structured_outputs=DIGITS)
    assert re.fullmatch("[0-9]{3}", llm.generate(prompt, direct, use_tqdm=False)[0].outputs[0].text)


def test_a_parser_needs_its_tags_as_tokens():
    with pytest.raises(ValueError, match="'<think>' to be one token"):
        LLM("tiny", cpu_kv_cache_gib=0.01, reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        LLM("tiny", cpu_kv_cache_gib=0.01, reasoning_parser="nope")


# ---- server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(thinker_dir):
    argv = [str(thinker_dir), "--served-model-name", "thinker", "--max-model-len", "256",
            "--cpu-kv-cache-gib", "0.02", "--disable-log-stats",
            "--reasoning-parser", "deepseek_r1"]  # fmt: skip
    srv = ServerThread(build(make_parser().parse_args(argv))).start()
    yield srv
    srv.stop()


def test_server_returns_the_thought_as_reasoning(server, tags):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    ask = dict(model="thinker", messages=[{"role": "user", "content": "hi"}], temperature=0,
               max_tokens=8, extra_body={"ignore_eos": True})  # fmt: skip
    message = client.chat.completions.create(**ask).choices[0].message
    extra = message.model_extra
    assert message.content is None and extra["reasoning"] == extra["reasoning_content"]
    assert extra["reasoning"]  # no </think> yet: everything is thought
    thought = ""
    for chunk in client.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning") or ""
            assert not choice.delta.content
    assert thought == extra["reasoning"]
    # the grammar starts after the thought: a JSON answer after an (empty, forced) thought
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = {**ask, "max_tokens": 30, "extra_body": {}, "logit_bias": {str(tags[1]): 100},
            "response_format": fmt}  # fmt: skip
    message = client.chat.completions.create(**body).choices[0].message
    assert isinstance(json.loads(message.content)["ok"], bool)
    assert message.model_extra["reasoning"] is None
    # /tokenize still sees the plain template; other routes are unaffected
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "<think>"}).json()["tokens"]
    assert tokens[-1] == tags[0]


def test_responses_carry_the_thought_as_a_reasoning_item(server, tags):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    ask = dict(model="thinker", input="hi", temperature=0, max_output_tokens=8,
               extra_body={"ignore_eos": True})  # fmt: skip
    r = client.responses.create(**ask)
    assert [it.type for it in r.output] == ["reasoning"] and r.output_text == ""
    assert r.output[0].content[0].text and r.usage.output_tokens_details.reasoning_tokens == 8
    events = list(client.responses.create(stream=True, **ask))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == r.output[0].content[0].text
    assert events[-1].response.output[0].content[0].text == thought
    # an answer after a (forced, empty) thought: no reasoning item, the JSON as the message
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
    body = {**ask, "max_output_tokens": 30, "text": fmt,
            "extra_body": {"logit_bias": {str(tags[1]): 100}}}  # fmt: skip
    r = client.responses.create(**body)
    assert [it.type for it in r.output] == ["message"] and r.status == "completed"
    assert isinstance(json.loads(r.output_text)["ok"], bool)
