"""Tool calling through the OpenAI-compatible server, end to end with the official client: named
and "required" tool choices (guided decoding makes the tiny random model's calls valid), "auto"
with the hermes parser (the reply's text forced by a regex, so the parser has calls to find),
streamed and whole, the tools in the prompt, and the request errors."""

import json
import re

import httpx
import openai
import pytest

from paged_llm.models.presets import default_model_dir
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser, server_settings
from paged_llm.serve.errors import BadRequest
from paged_llm.serve.tool_calls import parse_tools, tool_mode

MODEL = "tiny-tools"
# A Hermes-style template: the tools in a system block, earlier calls as <tool_call> blocks.
TEMPLATE = (
    "{% if tools %}<|system|>\nTools:\n{% for t in tools %}{{ t['function'] | tojson }}\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
DIGITS = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": DIGITS}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.fixture(scope="module")
def server():
    argv = [str(default_model_dir()), "--served-model-name", MODEL, "--max-model-len", "512",
            "--cpu-kv-cache-gib", "0.05", "--disable-log-stats", "--chat-template", TEMPLATE,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    srv = ServerThread(build(make_parser().parse_args(argv))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, **kw):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 60, "seed": 0, **kw}
    return client.chat.completions.create(**kw)


def streamed(client, **kw):
    """(content, calls as {"id", "name", "arguments"}, finish reason) rebuilt from a stream."""
    content, calls, finish = "", [], None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # a new call: id, type and name come first
                    assert d.index == len(calls) and d.type == "function"
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def check_valid(name, arguments):
    args = json.loads(arguments)
    if name == "get_weather":
        assert args["city"] in ("Paris", "Oslo")
    else:
        assert name == "add" and 0 <= args["a"] <= 9 and 0 <= args["b"] <= 9


def test_named_tool_choice_forces_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "add"}}
    for temperature in (0.0, 1.0):
        r = chat(client, tool_choice=choice, temperature=temperature)
        message = r.choices[0].message
        assert message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        check_valid(call.function.name, call.function.arguments)
        assert call.function.name == "add" and r.choices[0].finish_reason == "stop"
    content, calls, finish = streamed(client, tool_choice=choice, temperature=0)
    whole = chat(client, tool_choice=choice, temperature=0).choices[0].message.tool_calls[0]
    assert content == "" and finish == "stop" and len(calls) == 1
    assert (calls[0]["name"], calls[0]["arguments"]) == ("add", whole.function.arguments)


def test_required_tool_choice_calls_offered_tools(client):
    for seed in range(3):
        r = chat(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=120,
                 parallel_tool_calls=False)  # fmt: skip
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert finish == "tool_calls" and len(message.tool_calls) == 1
        check_valid(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)
    r = chat(client, tool_choice="required", temperature=0, max_tokens=120)
    content, calls, finish = streamed(client, tool_choice="required", temperature=0, max_tokens=120)
    whole = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == whole and whole
    assert finish == r.choices[0].finish_reason and content == ""
    for name, arguments in whole:
        check_valid(name, arguments)


def test_auto_tool_choice_parses_the_models_hermes_calls(client):
    force = {"structured_outputs": {"regex": "Checking\\. " + re.escape(FORCED_CALL)}}
    r = chat(client, temperature=0, extra_body=force)
    message = r.choices[0].message
    assert message.content == "Checking. " and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    content, calls, finish = streamed(client, temperature=0, extra_body=force)
    assert content == "Checking. " and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    # tools given, no call in the reply: plain content
    r = chat(client, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


def test_tools_reach_the_prompt_and_earlier_calls_render_as_objects(server, client):
    plain = chat(client, tools=openai.NOT_GIVEN, max_tokens=1).usage.prompt_tokens
    offered = chat(client, tool_choice="none", max_tokens=1)
    assert offered.usage.prompt_tokens > plain  # "none" still shows the tools, as vLLM does
    assert offered.choices[0].message.tool_calls in (None, [])
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    body = {"model": MODEL, "messages": history, "tools": TOOLS}
    tokens = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '"arguments": {"city": "Paris"}' in text  # an object, not JSON text in a string
    assert '"name": "add"' in text and "<|tool|>\nsunny" in text
    r = chat(client, messages=history, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tools": openai.NOT_GIVEN, "tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "non-empty 'name'"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "drop"),
    ],
)
def test_bad_tool_requests_are_400s(client, kw, message):
    with pytest.raises(openai.BadRequestError, match=message):
        chat(client, **kw)


def test_auto_needs_the_server_flags():
    argv = [str(default_model_dir()), "--chat-template", TEMPLATE]
    assert server_settings(make_parser().parse_args(argv)).tool_parser is None
    with pytest.raises(BadRequest, match="--enable-auto-tool-choice"):
        tool_mode(parse_tools(TOOLS), "auto", None)  # what such a server does with "auto"
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        server_settings(make_parser().parse_args([*argv, "--enable-auto-tool-choice"]))
    with pytest.raises(ValueError, match="unknown tool call parser"):
        server_settings(make_parser().parse_args([*argv, "--tool-call-parser", "x"]))
