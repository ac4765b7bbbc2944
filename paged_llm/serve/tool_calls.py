"""Tool calling for ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``, served
the way vLLM serves them.

The request's tools go to the chat template, which tells the model how to call them. What
becomes of the model's reply depends on ``tool_choice``; each choice is one class here:

- ``"none"``: the reply is text (the tools are still in the prompt, vLLM's default);
- ``"auto"`` (the default when tools are given): the model decides, and a parser for its
  tool-call format (``--tool-call-parser``, one of ``TOOL_PARSERS``: hermes, llama3_json,
  mistral, pythonic) finds the calls in the text;
- ``"required"``: guided decoding forces a JSON array of one or more calls of the given tools;
- ``{"type": "function", "function": {"name": ...}}``: guided decoding forces the arguments of
  that one function, as JSON valid for its parameters' schema.

Every mode turns a reply's text, or the text so far while it streams, into ``Parsed``: the
reply's content and its tool calls. A stream sends the difference between successive
``Parsed`` values, so a mode's ``parse`` may only grow as text is appended: the content by
appending to it, the calls by appending calls (only the last call's arguments may grow).
"""

from __future__ import annotations

import ast
import contextlib
import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from paged_llm.engine.deltas import partial_suffix
from paged_llm.sampling_params import StructuredOutputsParams
from paged_llm.serve.errors import BadRequest

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function the client offers (``{"type": "function", "function": {...}}``)."""

    name: str
    parameters: dict[str, Any]  # a JSON schema; a tool without one takes an empty object
    raw: dict[str, Any]  # as sent, for the chat template


@dataclass(frozen=True)
class Call:
    """A tool call found in a reply; ``arguments`` is JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """A reply split into its content and its tool calls."""

    content: str
    calls: tuple[Call, ...] = ()


def new_call_id() -> str:
    """A tool call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse_tools(raw: list[Any] | None) -> list[Tool]:
    """The request's ``tools``, checked; BadRequest naming the first bad entry."""
    tools = []
    for i, entry in enumerate(raw or []):
        where = f"tools[{i}]"
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{...}}}}',
                             param="tools")  # fmt: skip
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not (function["name"])
        ):
            raise BadRequest(f"{where}.function needs a non-empty 'name'", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"{where}.function.parameters must be a JSON schema object",
                             param="tools")  # fmt: skip
        tools.append(Tool(function["name"], parameters or EMPTY_PARAMETERS, entry))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest(f"tool names must be unique, got {names}", param="tools")
    return tools


# What reading a model's text may raise: it is untrusted (deep nesting, NUL bytes, sets)
_UNREADABLE = (ValueError, TypeError, RecursionError, MemoryError)


def _json_call(text: str, argument_keys: tuple[str, ...]) -> Call | None:
    """``{"name": ..., <argument key>: {...}}`` as a Call; None if ``text`` is anything else."""
    try:
        value = json.loads(text)
    except _UNREADABLE:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in argument_keys if k in value), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except _UNREADABLE:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_spans(text: str, start: int) -> tuple[list[tuple[int, int]], int]:
    """Where the complete JSON values in ``text`` from ``start`` are, separated by whitespace,
    commas or semicolons: ([(begin, end)], where parsing stopped)."""
    decoder = json.JSONDecoder()
    spans, pos = [], start
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        try:
            _, end = decoder.raw_decode(text, pos)
        except _UNREADABLE:  # incomplete (or not JSON): stop here
            return spans, pos
        spans.append((pos, end))
        pos = end


# ---- parsers for tool_choice "auto" -----------------------------------------------------------
class ToolParser(ABC):
    """Finds tool calls in a model's free text, in that model family's format."""

    # the format's marker is a special token: keep special tokens in the reply's text
    keeps_special_tokens = False

    @abstractmethod
    def parse(self, text: str, finished: bool) -> Parsed:
        """The reply so far as content and calls (see the module docstring's growth rule)."""

    def call_id(self) -> str:
        """A new call's id, in the form the family's chat template accepts back."""
        return new_call_id()


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    one block per call. Text before the first block is content; a block that is not a valid
    call stays in the content as text."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, finished: bool) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            keep = len(text) if finished else len(text) - partial_suffix(text, self.start)
            return Parsed(text[:keep])
        content, calls, pos = [text[:first]], [], first
        while pos >= 0:
            body = pos + len(self.start)
            close = text.find(self.end, body)
            if close < 0:  # an open block: a call only once the reply ends without closing it
                if finished:
                    call = _json_call(text[body:].strip(), ("arguments",))
                    content.append(text[pos:] if call is None else "")
                    calls += [call] if call else []
                break
            call = _json_call(text[body:close].strip(), ("arguments",))
            if call is None:
                content.append(text[pos : close + len(self.end)])
            else:
                calls.append(call)
            pos, after = text.find(self.start, close), close + len(self.end)
            between = text[after : pos if pos >= 0 else len(text)]
            if pos >= 0 or finished:  # text between blocks is final once the next one starts
                content.append(between if between.strip() else "")
        return Parsed("".join(content), tuple(calls))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}``
    (or ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``. A
    reply that starts otherwise is content; so is a JSON value in it that is not a call."""

    tag = "<|python_tag|>"

    def parse(self, text: str, finished: bool) -> Parsed:
        stripped = text.lstrip()
        if not finished and (not stripped or self.tag.startswith(stripped)):
            return Parsed("")  # cannot tell yet whether this is a call
        tagged = stripped.startswith(self.tag)
        body = stripped[len(self.tag) :] if tagged else stripped
        # plain text streams as content; after the tag, whatever it is waits for the end
        if not body.lstrip().startswith("{"):
            return Parsed(text if finished or not tagged else "")
        offset = len(text) - len(body)
        spans, stop = _json_spans(text, offset)
        content, calls = [], []
        for begin, end in spans:
            call = _json_call(text[begin:end], ("parameters", "arguments"))
            if call is None:
                content.append(text[begin:end])
            else:
                calls.append(call)
        if finished and text[stop:].strip():
            content.append(text[stop:])
        return Parsed("".join(content), tuple(calls))


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3 to v7),
    or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 on, e.g. Mistral Small 3.2). Text
    before the marker is content. ``[TOOL_CALLS]`` is a special token, so replies keep special
    tokens in their text while tools are offered; call ids are 9 letters and digits, the only
    form Mistral's chat templates accept back."""

    marker, args = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True

    def parse(self, text: str, finished: bool) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            keep = len(text) if finished else len(text) - partial_suffix(text, self.marker)
            return Parsed(text[:keep])
        body = at + len(self.marker)
        start = text.find("[", body)
        if start < 0 or text[body:start].strip():  # the v11 form (or not decidable yet)
            return self._named_calls(text, at, finished)
        spans, stop = _json_spans(text, start + 1)  # each call is final once its object closes
        content, calls = [text[:at]], []
        for begin, end in spans:
            call = _json_call(text[begin:end], ("arguments", "parameters"))
            content += [text[begin:end]] if call is None else []
            calls += [call] if call is not None else []
        rest = text[stop:].strip()
        if finished and rest != "]":  # whatever is not a call stays text
            content.append(text[stop:])
        return Parsed("".join(content), tuple(calls))

    def _named_calls(self, text: str, at: int, finished: bool) -> Parsed:
        """``[TOOL_CALLS]name[ARGS]{...}`` repeated: each call is final once its object
        closes; what does not read as one stays text once the reply ends."""
        decoder = json.JSONDecoder()
        content, calls, pos = [text[:at]], [], at
        while pos >= 0:
            name_from = pos + len(self.marker)
            args_at = text.find(self.args, name_from)
            name = text[name_from:args_at].strip() if args_at >= 0 else ""
            value, end = None, -1
            if name:
                json_from = args_at + len(self.args)
                json_from += len(text[json_from:]) - len(text[json_from:].lstrip())
                with contextlib.suppress(*_UNREADABLE):  # incomplete JSON: wait, or text
                    value, end = decoder.raw_decode(text, json_from)
            if not isinstance(value, dict):  # incomplete, or not a call
                content += [text[pos:]] if finished else []
                break
            calls.append(Call(name, json.dumps(value, ensure_ascii=False)))
            pos = text.find(self.marker, end)
            between = text[end : pos if pos >= 0 else len(text)]
            if (pos >= 0 or finished) and between.strip():
                content.append(between)
        return Parsed("".join(content), tuple(calls))

    def call_id(self) -> str:
        return uuid.uuid4().hex[:9]


class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4's pythonic calls: the reply is a Python list of calls with literal
    keyword arguments, ``[get_weather(city="Paris"), add(a=1, b=2)]``. A reply that starts
    otherwise is content; one that starts with ``[`` waits for its end to be read."""

    def parse(self, text: str, finished: bool) -> Parsed:
        stripped = text.strip()
        if not stripped.startswith("["):
            return Parsed(text if stripped or finished else "")
        if not finished:
            return Parsed("")
        calls = _pythonic_calls(stripped)
        return Parsed(text) if calls is None else Parsed("", tuple(calls))


def _pythonic_calls(text: str) -> list[Call] | None:
    """``[f(a=1), g()]`` as calls; None unless it is exactly a list of calls with literal
    keyword arguments."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, *_UNREADABLE):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            if None in arguments:  # **kwargs
                return None
            calls.append(Call(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (SyntaxError, *_UNREADABLE):  # not a literal, or not JSON (a set, bytes)
            return None
    return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError listing the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


# ---- tool_choice modes --------------------------------------------------------------------
class ToolMode(ABC):
    """What one ``tool_choice`` does to a reply."""

    # an engine finish "stop" becomes this when the reply made calls (None: stays "stop")
    calls_finish_reason: str | None = "tool_calls"

    def structured_output(self) -> StructuredOutputsParams | None:
        """The constraint guided decoding puts on the reply, if any."""
        return None

    def keeps_special_tokens(self) -> bool:
        """Whether replies must keep special tokens in their text (a parser's marker is one)."""
        return False

    def call_id(self) -> str:
        """A new call's id."""
        return new_call_id()

    @abstractmethod
    def parse(self, text: str, finished: bool) -> Parsed:
        """The reply so far as content and calls."""

    def finish_reason(self, parsed: Parsed, engine_reason: str | None) -> str | None:
        """The choice's finish reason once it has ``parsed``."""
        if parsed.calls and engine_reason == "stop" and self.calls_finish_reason:
            return self.calls_finish_reason
        return engine_reason


class AutoToolCalls(ToolMode):
    """``"auto"``: the parser decides what in the text is a call."""

    def __init__(self, parser: ToolParser):
        self.parser = parser

    def parse(self, text: str, finished: bool) -> Parsed:
        return self.parser.parse(text, finished)

    def keeps_special_tokens(self) -> bool:
        return self.parser.keeps_special_tokens

    def call_id(self) -> str:
        return self.parser.call_id()


class RequiredToolCalls(ToolMode):
    """``"required"``: the reply is a JSON array ``[{"name": ..., "parameters": {...}}, ...]``
    of calls of the offered tools (vLLM's schema), one call only without parallel calls."""

    def __init__(self, tools: list[Tool], parallel: bool = True):
        self.schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": [_call_schema(t) for t in tools]},
        }
        if not parallel:
            self.schema["maxItems"] = 1

    def structured_output(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.schema)

    def parse(self, text: str, finished: bool) -> Parsed:
        start = text.find("[")
        if start < 0:
            return Parsed("")
        spans, _ = _json_spans(text, start + 1)  # a call is final once its object closes
        calls = (_json_call(text[begin:end], ("parameters",)) for begin, end in spans)
        return Parsed("", tuple(c for c in calls if c is not None))


class NamedToolCall(ToolMode):
    """``{"type": "function", "function": {"name": ...}}``: the whole reply is the arguments
    of that function (they stream as they are generated)."""

    calls_finish_reason = None  # OpenAI and vLLM finish a forced call with "stop"

    def __init__(self, tool: Tool):
        self.tool = tool

    def structured_output(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.tool.parameters)

    def parse(self, text: str, finished: bool) -> Parsed:
        return Parsed("", (Call(self.tool.name, text),))


def _call_schema(tool: Tool) -> dict[str, Any]:
    """One array item of the "required" schema: a call of ``tool``."""
    return {
        "properties": {
            "name": {"type": "string", "enum": [tool.name]},
            "parameters": tool.parameters,
        },
        "required": ["name", "parameters"],
    }


def tool_mode(
    tools: list[Tool], tool_choice: Any, parser: ToolParser | None, parallel: bool = True
) -> ToolMode | None:
    """The mode of a request's ``tool_choice`` (None: a plain text reply); BadRequest for a
    choice that names no offered tool, needs tools that are missing, or needs a parser."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise BadRequest(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
    if tool_choice == "auto":
        if parser is None:
            raise BadRequest(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set; or send tool_choice "required", "none" or a named function',
                param="tool_choice",
            )
        return AutoToolCalls(parser)
    if tool_choice == "required":
        return RequiredToolCalls(tools, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type") != "function":
        raise BadRequest(
            'tool_choice must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
            param="tool_choice",
        )
    named = [t for t in tools if t.name == function.get("name")]
    if not named:
        raise BadRequest(
            f"tool_choice names {function.get('name')!r}, which is not among the tools "
            f"{[t.name for t in tools]}",
            param="tool_choice",
        )
    return NamedToolCall(named[0])


# ---- responses ------------------------------------------------------------------------------
def call_json(call: Call, call_id: str) -> dict[str, Any]:
    """A call as OpenAI's ``tool_calls`` entry."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
