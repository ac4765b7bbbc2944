"""A chat reply's text -> its OpenAI message: the thinking split off first (with a reasoning
parser, ``engine/reasoning.py``), then tool calls found in what remains (with tools,
``tool_calls.py``), the rest being ``content``.

Whole replies are parsed once; streamed ones are parsed again after every text delta and the
difference is sent. Each part only grows as text is appended (the parsers guarantee it), so a
stream adds up to the whole reply.
"""

from __future__ import annotations

from typing import Any

from paged_llm.engine.reasoning import ReasoningParser
from paged_llm.serve.tool_calls import Parsed, ToolMode, call_json


class ChatReply:
    """How one request's replies are read."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolMode | None):
        self.reasoning = reasoning
        self.tools = tools

    def parse(self, text: str, finished: bool) -> tuple[str, Parsed]:
        """(reasoning, content and calls) of a reply so far."""
        thought, rest = self.reasoning.split(text, finished) if self.reasoning else ("", text)
        return thought, self.tools.parse(rest, finished) if self.tools else Parsed(rest)

    def finish_reason(self, parsed: Parsed, engine_reason: str | None) -> str | None:
        """A reply that made calls finishes with ``tool_calls`` (see ToolMode)."""
        return self.tools.finish_reason(parsed, engine_reason) if self.tools else engine_reason

    def message(self, text: str, engine_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A finished reply's ``message`` and finish reason."""
        thought, parsed = self.parse(text, finished=True)
        # null content beside calls or a thought (OpenAI's and vLLM's); a plain empty reply is ""
        content = parsed.content if parsed.content or not (parsed.calls or thought) else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:  # vLLM's current name, and the one it replaced
            message["reasoning"] = message["reasoning_content"] = thought or None
        if self.tools is not None:
            message["tool_calls"] = [call_json(c, self.tools.call_id()) for c in parsed.calls]
        return message, self.finish_reason(parsed, engine_reason)

    def stream(self) -> ChatReplyStream:
        """A cursor for one streamed choice."""
        return ChatReplyStream(self)


class ChatReplyStream:
    """One streamed choice's reasoning, content and tool-call deltas, from its text deltas."""

    def __init__(self, reply: ChatReply):
        self.reply = reply
        self.text = ""
        self.thought = ""
        self.parsed = Parsed("")
        self.ids: list[str] = []  # per call sent so far
        self.sent_arguments: list[int] = []  # characters of each call's arguments sent

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        """The chunk's ``delta`` fields (``content`` at least) after ``text`` is appended."""
        self.text += text
        thought, parsed = self.reply.parse(self.text, finished)
        delta: dict[str, Any] = {}
        if len(thought) > len(self.thought):
            delta["reasoning"] = delta["reasoning_content"] = thought[len(self.thought) :]
        content = parsed.content[len(self.parsed.content) :]
        calls = self._call_deltas(parsed)
        if content or not (calls or delta):  # OpenAI's call chunks carry no content
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        self.thought, self.parsed = thought, parsed
        return delta

    def _call_deltas(self, parsed: Parsed) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.ids):  # a new call: announce it with whatever arguments it has
                self.ids.append(self.reply.tools.call_id())
                self.sent_arguments.append(len(call.arguments))
                deltas.append({"index": i, **call_json(call, self.ids[i])})
            elif len(call.arguments) > self.sent_arguments[i]:
                new = call.arguments[self.sent_arguments[i] :]
                self.sent_arguments[i] = len(call.arguments)
                deltas.append({"index": i, "function": {"arguments": new}})
        return deltas

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The finish reason to stream, given the engine's."""
        return self.reply.finish_reason(self.parsed, engine_reason)
