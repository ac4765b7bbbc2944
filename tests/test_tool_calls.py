"""Tool calling without a model: the hermes and llama3_json parsers, the "required" and named
modes, that a streamed reply (split anywhere) adds up to the whole one, the checks on tools and
tool_choice, and the messages a chat template sees."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.engine.chat import render_chat, template_messages
from paged_llm.serve.errors import BadRequest
from paged_llm.serve.replies import ChatReply
from paged_llm.serve.tool_calls import (
    AutoToolCalls,
    Call,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolCall,
    Parsed,
    RequiredToolCalls,
    parse_tools,
    tool_mode,
    tool_parser,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
TOOLS = parse_tools([WEATHER, ADD])


def hermes_block(name, arguments, pad="\n"):
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{pad}{body}{pad}</tool_call>"


# ---- parsers ----------------------------------------------------------------------------------
def test_hermes_finds_calls_and_keeps_the_text_before_them():
    text = "Let me look. " + hermes_block("get_weather", {"city": "Paris"}) + "\n"
    text += hermes_block("add", {"a": 1, "b": 2}, pad="")
    parsed = HermesToolParser().parse(text, finished=True)
    assert parsed.content == "Let me look. "
    assert parsed.calls == (
        Call("get_weather", '{"city": "Paris"}'),
        Call("add", '{"a": 1, "b": 2}'),
    )


def test_hermes_malformed_blocks_stay_text_and_an_unclosed_last_call_counts():
    bad = "<tool_call>not json</tool_call>"
    parsed = HermesToolParser().parse("a " + bad + " b", finished=True)
    assert parsed == Parsed("a " + bad + " b")
    # arguments sent as JSON text are decoded; a reply cut before </tool_call> still calls
    unclosed = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}'
    assert HermesToolParser().parse(unclosed, finished=True).calls == (Call("add", '{"a": 1}'),)
    assert HermesToolParser().parse(unclosed, finished=False) == Parsed("")


def test_hermes_holds_back_what_may_become_a_tool_call_tag():
    parser = HermesToolParser()
    assert parser.parse("Hi <tool_c", finished=False) == Parsed("Hi ")
    assert parser.parse("Hi <tool_c", finished=True) == Parsed("Hi <tool_c")
    assert parser.parse("Hi <tools", finished=False) == Parsed("Hi <tools")


def test_llama3_json_calls_plain_text_and_json_that_is_not_a_call():
    parser = Llama3JsonToolParser()
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", '
    text += '"arguments": {"city": "Oslo"}}'
    parsed = parser.parse(text, finished=True)
    assert parsed.calls == (Call("add", '{"a": 1}'), Call("get_weather", '{"city": "Oslo"}'))
    assert parsed.content == ""
    assert parser.parse("The answer is 4.", finished=False) == Parsed("The answer is 4.")
    assert parser.parse('{"answer": 4}', finished=True) == Parsed('{"answer": 4}')
    assert parser.parse("<|python_", finished=False) == Parsed("")
    assert parser.parse('{"name": "add", "param', finished=False) == Parsed("")
    cut = '{"name": "add", "param'
    assert parser.parse(cut, finished=True) == Parsed(cut)  # cut short: the text is the reply


def test_mistral_calls_after_the_marker():
    parser = tool_parser("mistral")
    calls = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'
    parsed = parser.parse("Sure.[TOOL_CALLS]" + calls, finished=True)
    assert parsed == Parsed("Sure.", (Call("add", '{"a": 1}'), Call("get_weather", "{}")))
    # streamed: the first call is final once its object closes; the marker is held back
    assert parser.parse("Sure.[TOOL_CA", finished=False) == Parsed("Sure.")
    half = "[TOOL_CALLS]" + calls[:45]
    assert parser.parse(half, finished=False).calls == (Call("add", '{"a": 1}'),)
    assert parser.keeps_special_tokens  # [TOOL_CALLS] is a special token
    assert re.fullmatch("[0-9a-f]{9}", parser.call_id())  # what Mistral's templates accept
    assert parser.parse("[TOOL_CALLS]oops", finished=True) == Parsed("[TOOL_CALLS]oops")
    # tokenizer v11 on: [TOOL_CALLS]name[ARGS]{...} per call
    v11 = 'Ok [TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS] {"city": "Oslo"}'
    assert parser.parse(v11, finished=True) == Parsed(
        "Ok ", (Call("add", '{"a": 1}'), Call("get_weather", '{"city": "Oslo"}'))
    )
    first = v11[: v11.index("}") + 1]  # the first call's object just closed
    assert parser.parse(first, finished=False) == Parsed("Ok ", (Call("add", '{"a": 1}'),))
    assert parser.parse(first[:-1], finished=False) == Parsed("Ok ")
    assert parser.parse("[TOOL_CALLS]add[ARGS][1]", finished=True).calls == ()


def test_pythonic_calls():
    parser = tool_parser("pythonic")
    text = '[get_weather(city="Paris"), add(a=1, b=[2, 3])]'
    assert parser.parse(text, finished=True).calls == (
        Call("get_weather", '{"city": "Paris"}'),
        Call("add", '{"a": 1, "b": [2, 3]}'),
    )
    assert parser.parse(text, finished=False) == Parsed("")  # a list is read once it ends
    assert parser.parse("Plain answer", finished=False) == Parsed("Plain answer")
    for not_calls in ["[1, 2]", "[f(x)]", "[f(a=g())]", "[f(**k)]", "[unclosed("]:
        assert parser.parse(not_calls, finished=True) == Parsed(not_calls)


def test_parser_registry():
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="known: \\['hermes', 'llama3_json', 'mistral', 'pyth"):
        tool_parser("nope")


# ---- modes ------------------------------------------------------------------------------------
def test_required_mode_schema_and_parse():
    mode = RequiredToolCalls(TOOLS)
    schema = mode.structured_output().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    assert RequiredToolCalls(TOOLS, parallel=False).schema["maxItems"] == 1
    text = '[{"name":"add","parameters":{"a":1}},{"name":"get_weather","parameters":{"ci'
    assert mode.parse(text, finished=False).calls == (Call("add", '{"a": 1}'),)
    whole = text + 'ty":"Paris"}}]'
    parsed = mode.parse(whole, finished=True)
    assert [c.name for c in parsed.calls] == ["add", "get_weather"] and parsed.content == ""
    assert mode.finish_reason(parsed, "stop") == "tool_calls"
    assert mode.finish_reason(parsed, "length") == "length"


def test_named_mode_streams_the_arguments():
    mode = NamedToolCall(TOOLS[0])
    assert mode.structured_output().json == WEATHER["function"]["parameters"]
    stream = ChatReply(None, mode).stream()
    first = stream.feed("", finished=False)["tool_calls"]
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[0]["id"].startswith("chatcmpl-tool-") and first[0]["type"] == "function"
    more = stream.feed('{"city": ', finished=False)
    last = stream.feed('"Oslo"}', finished=True)
    assert more == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}
    assert last == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}
    assert stream.finish_reason("stop") == "stop"  # a forced call ends with "stop"
    message, finish = ChatReply(None, mode).message('{"city": "Oslo"}', "stop")
    assert finish == "stop" and message["content"] is None
    call = message["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_auto_reply_without_calls_is_plain_content():
    reply = ChatReply(None, AutoToolCalls(HermesToolParser()))
    message, finish = reply.message("Just text.", "stop")
    assert message == {"role": "assistant", "content": "Just text.", "tool_calls": []}
    assert finish == "stop"


PIECES = st.one_of(
    st.sampled_from(["Hi ", "a < b ", "<tool", "\n", "x", "{", "}", " done"]),
    st.builds(lambda a: hermes_block("add", {"a": a}), st.integers(0, 99)),
    st.builds(lambda c: hermes_block("get", {"city": c}, pad=""), st.text("ab", max_size=3)),
    st.just("<tool_call>oops</tool_call>"),
    st.just('<tool_call>{"name": "add"'),
    st.builds(lambda a: json.dumps({"name": "add", "parameters": {"a": a}}) + "; ", st.integers()),
    st.just("<|python_tag|>"),
    st.sampled_from(
        ["[TOOL_CALLS]", "[TOOL_", '[{"name": "add", "arguments": {"a": 1}}', ", ", "]"]
    ),
    st.sampled_from(["[add(a=1)]", '[get(city="x"), add(a=2)]', "[f(", ")]"]),
    st.sampled_from(["add[ARGS]", '{"a": 2}', "[ARG", "x[ARGS]"]),  # Mistral v11
)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(PIECES, max_size=6),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    parser=st.sampled_from(["hermes", "llama3_json", "mistral", "pythonic"]),
)
def test_a_stream_split_anywhere_adds_up_to_the_whole_reply(pieces, cuts, parser):
    """Content and calls streamed in chunks equal the whole reply's; nothing is sent twice."""
    text = "".join(pieces)
    reply = ChatReply(None, AutoToolCalls(tool_parser(parser)))
    whole, finish = reply.message(text, "stop")
    stream = reply.stream()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    content, calls = "", {}
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:] + [len(text)])):
        delta = stream.feed(text[lo:hi], finished=i == len(bounds) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["index"] == len(calls)
                calls[d["index"]] = dict(d["function"])
            else:
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert content == (whole["content"] or "")
    assert [calls[i] for i in range(len(calls))] == [c["function"] for c in whole["tool_calls"]]
    assert stream.finish_reason("stop") == finish


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(
            list('[]{}(),;:="ab1 \x00')
            + ["<tool_call>", "[TOOL_CALLS]", "f(a=", "{1, 2}", "b'x'", '"name"', "</tool_call>"]
        ),
        max_size=40,
    ).map("".join),
    parser=st.sampled_from(["hermes", "llama3_json", "mistral", "pythonic"]),
    finished=st.booleans(),
)
def test_any_text_parses_without_raising(text, parser, finished):
    """A model's text is untrusted: nothing in it may break the response."""
    parsed = tool_parser(parser).parse(text, finished)
    for call in parsed.calls:
        json.loads(call.arguments)


def test_deeply_nested_or_odd_literals_are_text():
    deep = "[" * 5000 + "]" * 5000
    for name in ("hermes", "llama3_json", "mistral", "pythonic"):
        for text in (deep, '{"name": "f", "arguments": ' + "[" * 5000 + "}", "[f(a={1, 2})]",
                     "[f(a=b'x')]", "[f(a=1j)]", "[f(\x00)]"):  # fmt: skip
            assert tool_parser(name).parse(text, finished=True).calls == ()


# ---- checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tools, message",
    [
        ([{"type": "code"}], "must be"),
        ([{"type": "function", "function": {}}], "non-empty 'name'"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "JSON schema"),
        ([ADD, ADD], "unique"),
    ],
)
def test_bad_tools_are_named(tools, message):
    with pytest.raises(BadRequest, match=message):
        parse_tools(tools)


def test_tool_choice_resolution_and_its_errors():
    hermes = HermesToolParser()
    assert tool_mode([], None, hermes) is None  # no tools: plain chat
    assert tool_mode(TOOLS, "none", hermes) is None
    assert isinstance(tool_mode(TOOLS, None, hermes), AutoToolCalls)  # tools default to auto
    assert isinstance(tool_mode(TOOLS, "required", None), RequiredToolCalls)
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    assert isinstance(named, NamedToolCall) and named.tool.name == "add"
    assert named.tool.parameters == {"type": "object"}
    assert parse_tools([{"type": "function", "function": {"name": "f"}}])[0].parameters == {
        "type": "object",
        "properties": {},
    }
    for tools, choice, parser, message in [
        (TOOLS, None, None, "--enable-auto-tool-choice"),
        ([], "required", hermes, "needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "not among"),
        (TOOLS, "sometimes", hermes, "tool_choice must be"),
        (TOOLS, {"function": {"name": "add"}}, None, "tool_choice must be"),
    ]:
        with pytest.raises(BadRequest, match=message):
            tool_mode(tools, choice, parser)


def test_templates_see_earlier_arguments_as_objects_and_the_tools():
    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    seen = template_messages(messages)
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not mutated
    assert seen[0] is messages[0] and seen[2] is messages[2]

    class Tokenizer:  # what render_chat needs of a tokenizer
        chat_template = "unused"

        def apply_chat_template(self, msgs, chat_template, tokenize, **kw):
            return json.dumps({"messages": msgs, "tools": kw.get("tools")})

        def encode(self, text, add_special_tokens):
            return [len(text)]

    text, _ = render_chat(Tokenizer(), messages, tools=[ADD])
    rendered = json.loads(text)
    assert rendered["tools"] == [ADD]
    assert rendered["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    text, _ = render_chat(Tokenizer(), messages)
    assert json.loads(text)["tools"] is None  # no tools: the template is called without them
