"""OpenAI's Responses API (``POST /v1/responses``), served on the chat path as vLLM serves it.

A request becomes a chat request (``to_chat_request``): ``instructions`` a leading system
message, ``input`` items messages (text, earlier function calls and their outputs), function
tools and ``tool_choice`` chat's form, ``text.format`` ``response_format``, and
``max_output_tokens`` ``max_tokens``. Generation, tool calls and reasoning then run exactly as for
``/v1/chat/completions``; only the answer's shape differs: a ``response`` object whose ``output``
is a list of items (``reasoning``, ``message``, ``function_call``), streamed as typed events.

``OutputBuilder`` turns the chat reply's deltas (reasoning, content, tool calls; see
``replies.py``) into those items and events, one item at a time in the order the model wrote
them (text between or after calls is a message item of its own). A response that is not
streamed is built by the same steps from the same deltas, so it equals the streamed one's
``response.completed``.

Finished responses are kept in a bounded in-memory ``ResponseStore`` (unless ``store`` is
false), so ``previous_response_id`` continues a conversation and ``GET /v1/responses/{id}``
reads one back.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from paged_llm.serve.errors import BadRequest, NotFound
from paged_llm.serve.protocol import ChatCompletionRequest, validate_request

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's fields, and vLLM's sampling extensions."""

    model_config = ConfigDict(extra="allow")
    # vLLM's sampling fields, handed to the chat request as sent (it checks their types)
    passthrough: ClassVar[frozenset[str]] = frozenset({
        "top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos", "min_tokens",
        "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "bad_words",
        "allowed_token_ids", "priority", "chat_template_kwargs",
    })  # fmt: skip

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: to the chat template
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    truncation: str | None = "disabled"


# ---- request -> chat request -----------------------------------------------------------------
def input_messages(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages: text messages, an assistant's function calls
    (consecutive calls joined into one assistant message), tool outputs; earlier reasoning
    items are dropped, as chat templates drop earlier thoughts."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    if not input:
        raise BadRequest("input must not be empty", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise BadRequest(f"{where}.role must be one of {list(INPUT_ROLES)}, got {role!r}",
                                 param="input")  # fmt: skip
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _call_of(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn's calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where} (function_call_output) needs a 'call_id'",
                                 param="input")  # fmt: skip
            content = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind != "reasoning":
            raise BadRequest(
                f"{where}: item type {kind!r} is not supported; paged-llm takes message, "
                "function_call, function_call_output and reasoning items",
                param="input",
            )
    return out


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or text parts joined with newlines (as chat joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be text or a list of text parts", param="input")
    texts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}: only text parts are supported, got {kind!r}",
                             param="input")  # fmt: skip
        texts.append(part["text"])
    return "\n".join(texts)


def _call_of(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` input item as a chat ``tool_calls`` entry."""
    fields = ("call_id", "name", "arguments")
    if not all(isinstance(item.get(f), str) for f in fields):
        raise BadRequest(f"{where} (function_call) needs string fields {list(fields)}",
                         param="input")  # fmt: skip
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools (``{"type": "function", "name", "parameters", ...}``) in
    chat's form; tools of other types (web search, files, ...) are a 400."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(f"tools[{i}]: only function tools are supported, got {kind!r}",
                             param="tools")  # fmt: skip
        if "function" in tool:  # already chat's form
            out.append(tool)
            continue
        keys = ("name", "description", "parameters", "strict")
        out.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "function", "name": ...}`` in chat's form; the rest as sent (the chat path
    names a wrong one)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadRequest("text.format must be an object", param="text")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema",
                "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}  # fmt: skip
    return fmt


def to_chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> Any:
    """The chat request that generates this response, for the ``conversation`` so far (the
    earlier turns and this input) behind the request's instructions."""
    if req.background and (req.stream or not req.store):
        raise BadRequest("a background response needs store=true and cannot be streamed here "
                         "(poll GET /v1/responses/{id} instead)", param="background")  # fmt: skip
    if req.truncation not in (None, "disabled"):
        raise BadRequest('only truncation "disabled" is supported', param="truncation")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise BadRequest(f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                         param="max_output_tokens")  # fmt: skip
    data = {k: v for k, v in (req.model_extra or {}).items() if k in req.passthrough}
    template_kwargs = dict(data.pop("chat_template_kwargs", None) or {})
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:  # templates of reasoning models read it (gpt-oss's, for one)
        template_kwargs.setdefault("reasoning_effort", effort)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    data.update(
        model=req.model,
        messages=system + conversation,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format(req.text),
        chat_template_kwargs=template_kwargs or None,
    )
    return validate_request(data, ChatCompletionRequest)


# ---- reply -> output items and events --------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """A response's ``output`` items, built from its chat reply's deltas (the ``delta`` dicts
    of ``ChatReplyStream.feed``), and the events that announce each change."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (always the last)
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self._events: list[dict[str, Any]] = []

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold in one chat delta; the events it causes (without sequence numbers)."""
        if delta.get("reasoning"):
            self._append_text("reasoning", delta["reasoning"])
        if delta.get("content"):
            self._append_text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a new call
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "",
                        "status": "in_progress"}  # fmt: skip
                self._open(item)
                self.calls[call["index"]] = item
            arguments = call["function"].get("arguments") or ""
            if arguments:
                item = self.calls[call["index"]]
                item["arguments"] += arguments
                self._emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=self._index(item), delta=arguments)  # fmt: skip
        return self._take()

    def close(self, status: str) -> list[dict[str, Any]]:
        """Finish the open item (``status``: completed or incomplete); the events."""
        if self.open is not None:
            self._finish(self.open, status)
            self.open = None
        return self._take()

    def _append_text(self, kind: str, text: str) -> None:
        item = self.open
        if item is None or item["type"] != kind:
            item = self._open_text(kind)
        part = item["content"][0]
        part["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        extra = {"logprobs": []} if kind == "message" else {}
        self._emit(f"response.{name}.delta", item_id=item["id"], output_index=self._index(item),
                   content_index=0, delta=text, **extra)  # fmt: skip

    def _open_text(self, kind: str) -> dict[str, Any]:
        if kind == "message":
            item = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
        self._open(item)
        item["content"].append(part)
        self._emit("response.content_part.added", item_id=item["id"],
                   output_index=self._index(item), content_index=0, part=dict(part))  # fmt: skip
        return item

    def _open(self, item: dict[str, Any]) -> None:
        if self.open is not None:
            self._finish(self.open, "completed")
        self.items.append(item)
        self.open = item
        added = {**item, "content": []} if "content" in item else dict(item)
        self._emit("response.output_item.added", output_index=self._index(item), item=added)

    def _finish(self, item: dict[str, Any], status: str) -> None:
        where = {"item_id": item["id"], "output_index": self._index(item)}
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=item["arguments"])  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._emit("response.output_text.done", **where, content_index=0,
                           text=part["text"], logprobs=[])  # fmt: skip
            else:
                self._emit("response.reasoning_text.done", **where, content_index=0,
                           text=part["text"])  # fmt: skip
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        item["status"] = status
        self._emit("response.output_item.done", output_index=where["output_index"],
                   item=_copy(item))  # fmt: skip

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append({"type": kind, **fields})

    def _take(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item (its content parts copied, as they keep growing)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


def output_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat message that continues its conversation (reasoning
    left out, as chat templates leave out earlier thoughts)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None, dict | None]:
    """(response status, incomplete_details, error) for the engine's finish reason; an abort
    (the server shutting down) fails the response."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish_reason == "abort":
        return "failed", None, {"code": "aborted", "message": "the request was aborted"}
    return "completed", None, None


def reasoning_tokens(token_ids: Sequence[int], thought: str, end_id: int | None) -> int:
    """Generated tokens spent thinking: up to and with the end tag (all of them while the
    thought is still open); 0 without a thought."""
    if not thought or end_id is None:
        return 0
    ids = list(token_ids)
    return ids.index(end_id) + 1 if end_id in ids else len(ids)


def response_json(
    rid: str,
    created: int,
    model: str,
    req: ResponsesRequest,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None = None,
    incomplete: dict[str, str] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``response`` object: the request's settings and the output so far."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": [_copy(item) for item in output],
        "usage": usage,
        "incomplete_details": incomplete,
        "error": error,
        "instructions": req.instructions,
        "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": list(req.tools or []),
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "text": req.text or {"format": {"type": "text"}},
        "reasoning": req.reasoning,
        "metadata": req.metadata or {},
        "store": req.store,
        "truncation": req.truncation or "disabled",
        "background": req.background,
        "user": req.user,
        "completed_at": int(time.time()) if status == "completed" else None,
    }


def usage_json(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    """Responses' usage block."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


class EventSequence:
    """Numbers a stream's events (``sequence_number``) and writes them as SSE."""

    def __init__(self) -> None:
        self.next = 0

    def sse(self, event: dict[str, Any], dumps: Callable[[Any], str]) -> str:
        """One event as ``event: <type>`` / ``data: <json>``."""
        event = {**event, "sequence_number": self.next}
        self.next += 1
        return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


# ---- one response being generated ------------------------------------------------------------
class ResponseRun:
    """One response in progress: its request, its (single) chat choice's progress
    (``render.Choices`` with a chat reply), its output items, and its events."""

    def __init__(
        self,
        rid: str,
        model: str,
        req: ResponsesRequest,
        choices: Any,  # render.Choices of one choice, with a ChatReply
        conversation: list[dict[str, Any]],
        reasoning_end_id: int | None = None,  # the end tag's token id (reasoning token counts)
    ):
        self.rid, self.model, self.req = rid, model, req
        self.choices = choices
        self.conversation = conversation
        self.reasoning_end_id = reasoning_end_id
        self.created = int(time.time())
        self.builder = OutputBuilder()
        self.final: dict[str, Any] | None = None  # the finished response

    def opening_events(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        body = self._body("in_progress")
        return [{"type": "response.created", "response": body},
                {"type": "response.in_progress", "response": body}]  # fmt: skip

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The events of the reply's next text delta."""
        stream = self.choices.choices[0].reply_stream
        return self.builder.feed(stream.feed(text, finished=finished))

    def finish(self) -> list[dict[str, Any]]:
        """The closing events; the finished response is then ``final``."""
        choice = self.choices.choices[0]
        status, incomplete, error = status_of(choice.finish_reason)
        events = self.builder.close("incomplete" if status == "incomplete" else "completed")
        usage = self.choices.usage()
        thought = choice.reply_stream.thought
        body = self._body(
            status,
            usage_json(usage["prompt_tokens"], usage["completion_tokens"],
                       sum(self.choices.cached_tokens.values()),
                       reasoning_tokens(choice.token_ids, thought, self.reasoning_end_id)),
            incomplete,
            error,
        )  # fmt: skip
        events.append({"type": f"response.{status}", "response": body})  # .completed, ...
        self.final = body
        return events

    def failed(self, code: str, message: str) -> list[dict[str, Any]]:
        """The events of a stream that ends in an error."""
        body = self._body("failed", error={"code": code, "message": message})
        return [{"type": "error", "code": code, "message": message, "param": None},
                {"type": "response.failed", "response": body}]  # fmt: skip

    def stored_conversation(self) -> list[dict[str, Any]]:
        """The conversation this response ends: its input and its reply."""
        return self.conversation + output_messages(self.builder.items)

    def store_in(self, store: ResponseStore) -> None:
        """Keep the finished response (unless the request said not to)."""
        if self.req.store and self.final is not None:
            store.put(self.final, self.stored_conversation(), stored_input_items(self.req.input))

    def store_unfinished(self, store: ResponseStore, status: str, **fields: Any) -> dict:
        """Keep a background response that is not finished ("queued", "in_progress") or never
        will be ("cancelled", "failed" with ``error``): its output so far, no conversation to
        continue. Returns the body."""
        body = self._body(status, **fields)
        store.put(body, None, stored_input_items(self.req.input))
        return body

    def _body(self, status: str, usage: Any = None, incomplete: Any = None,
              error: Any = None) -> dict[str, Any]:  # fmt: skip
        return response_json(self.rid, self.created, self.model, self.req, self.builder.items,
                             status, usage, incomplete, error)  # fmt: skip


# ---- store ------------------------------------------------------------------------------------
def stored_input_items(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as OpenAI lists it back: items with ids, text as content parts."""
    raw = [{"role": "user", "content": input}] if isinstance(input, str) else input
    out = []
    for item in raw:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
        item.setdefault("id", _new_id(prefix.get(item["type"], "item")))
        out.append(item)
    return out


@dataclass
class _Stored:
    body: dict[str, Any]  # the response
    # chat messages up to and with its reply (None: unfinished, nothing to continue from)
    conversation: list[dict[str, Any]] | None
    input_items: list[dict[str, Any]]  # its request's input, as listed back


class ResponseStore:
    """Finished responses by id, with the conversation each ends (its messages, for
    ``previous_response_id``) and its input items; beyond ``capacity`` the oldest are
    forgotten."""

    def __init__(self, capacity: int = 1000):
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, _Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        body: dict[str, Any],
        conversation: list[dict[str, Any]] | None,
        input_items: list[dict[str, Any]] | None = None,
    ) -> None:
        """Keep a response, its whole conversation (None while it cannot be continued) and its
        input items; a later put of the same id replaces it."""
        if self.capacity == 0:
            return
        self._entries[body["id"]] = _Stored(body, conversation, input_items or [])
        self._entries.move_to_end(body["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> dict[str, Any]:
        """The response ``rid``; NotFound if it was never stored or is forgotten."""
        return self._entry(rid, "id").body

    def conversation(self, rid: str) -> list[dict[str, Any]]:
        """The messages of ``rid``'s conversation, its reply included (a copy)."""
        conversation = self._entry(rid, "previous_response_id").conversation
        if conversation is None:
            status = self._entries[rid].body["status"]
            raise BadRequest(f"response '{rid}' is {status}: it has no reply to continue from",
                             param="previous_response_id")  # fmt: skip
        return [dict(m) for m in conversation]

    def input_items(
        self, rid: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        """OpenAI's list of ``rid``'s input items (newest first by default), a page of at most
        ``limit`` after the item ``after``."""
        if order not in ("asc", "desc"):
            raise BadRequest(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        if not 1 <= limit <= 100:
            raise BadRequest(f"limit must be between 1 and 100, got {limit}", param="limit")
        items = list(self._entry(rid, "id").input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise BadRequest(f"no input item '{after}' in response '{rid}'", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "has_more": len(items) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None}  # fmt: skip

    def delete(self, rid: str) -> None:
        """Forget ``rid``; NotFound if unknown."""
        self._entry(rid, "id")
        del self._entries[rid]

    def _entry(self, rid: str, param: str) -> _Stored:
        entry = self._entries.get(rid)
        if entry is None:
            raise NotFound(f"Response with id '{rid}' not found.", param=param)
        return entry
