"""The Responses API (``/v1/responses``): request items translated to chat messages, output
items and events built from chat deltas (a stream adds up to the whole response, checked on
random cuts of replies with thoughts, text and calls), the store, and the server end to end
with the official client: text, instructions and previous_response_id in the prompt, streamed
equals whole, function tools in every tool_choice, structured output, and the errors."""

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.engine.reasoning import reasoning_parser
from paged_llm.models.presets import default_model_dir
from paged_llm.outputs import CompletionOutput, RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.app import _response_sse
from paged_llm.serve.async_engine import Update
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser
from paged_llm.serve.errors import BadRequest, EngineUnavailable, NotFound
from paged_llm.serve.render import Choices
from paged_llm.serve.replies import ChatReply
from paged_llm.serve.responses import (
    OutputBuilder,
    ResponseRun,
    ResponsesRequest,
    ResponseStore,
    input_messages,
    output_messages,
    reasoning_tokens,
    to_chat_request,
)
from paged_llm.serve.tool_calls import AutoToolCalls, HermesToolParser

MODEL = "tiny-responses"
TEMPLATE = (
    "{% if tools %}<|system|>\nTools:\n{% for t in tools %}{{ t['function'] | tojson }}\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% if m.get('tool_call_id') %} ({{ m['tool_call_id'] }}){% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather now",
          "parameters": CITY}]  # fmt: skip
FUNCTION = {k: TOOLS[0][k] for k in ("name", "description", "parameters")}
CHAT_TOOLS = [{"type": "function", "function": FUNCTION}]  # TOOLS in chat's form
FORCED_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def request(**fields):
    return ResponsesRequest.model_validate({"input": "hi", **fields})


# ---- translation -----------------------------------------------------------------------------
def test_input_items_become_chat_messages():
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped
        {"role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        call,  # a call after a tool output opens a new assistant message
    ]  # fmt: skip
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert input_messages(items) == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me see",
         "tool_calls": [tool_call, {**tool_call, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"input": []}, "must not be empty"),
        ({"input": [{"role": "robot", "content": "x"}]}, "role must be one of"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "only text parts"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item type 'item_reference'"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "needs string fields"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "needs a 'call_id'"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"background": True, "store": False}, "background response needs store=true"),
        ({"background": True, "stream": True}, "cannot be streamed"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens must be at least 1"),
        ({"text": {"format": "json"}}, "text.format must be an object"),
        ({"top_k": "many"}, "invalid 'top_k'"),  # passed on, checked by the chat request
    ],
)  # fmt: skip
def test_bad_requests_name_the_problem(fields, words):
    req = request(**fields)
    with pytest.raises(BadRequest, match=re.escape(words)):
        to_chat_request(req, input_messages(req.input))


def test_tools_choice_format_and_extensions_take_chats_form():
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": CITY, "strict": True}}
    req = request(instructions="sys", tools=TOOLS, text=fmt, top_k=5, seed=3,
                  tool_choice={"type": "function", "name": "get_weather"},
                  reasoning={"effort": "low"}, max_output_tokens=7)  # fmt: skip
    chat = to_chat_request(req, input_messages(req.input))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.messages[0].content == "sys" and chat.max_tokens == 7
    assert chat.tools == CHAT_TOOLS
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    schema = {"name": "w", "schema": CITY}
    assert chat.response_format == {"type": "json_schema", "json_schema": schema}
    assert (chat.top_k, chat.seed) == (5, 3)
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


# ---- output items and events -----------------------------------------------------------------
R1 = reasoning_parser("deepseek_r1")
PIECES = ["plan", " more plan", "</think>", "Sure. ", FORCED_CALL, " ", FORCED_CALL, " done"]


def feed_reply(reply, text, cuts):
    """(items, events) of ``text`` fed to a reply stream in the pieces ``cuts`` make."""
    stream, builder, events = reply.stream(), OutputBuilder(), []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        events += builder.feed(stream.feed(text[a:b], finished=i == len(bounds) - 2))
    events += builder.close("completed")
    return builder.items, events


def texts(items, kind):
    return [it["content"][0]["text"] for it in items if it["type"] == kind]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_streamed_items_hold_the_whole_reply(data):
    n = data.draw(st.integers(1, len(PIECES)))
    text = "".join(PIECES[:n])
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=12))
    reply = ChatReply(R1, AutoToolCalls(HermesToolParser()))
    items, events = feed_reply(reply, text, cuts)
    thought, parsed = reply.parse(text, finished=True)
    assert texts(items, "reasoning") == ([thought] if thought else [])
    assert "".join(texts(items, "message")) == parsed.content
    calls = [it for it in items if it["type"] == "function_call"]
    assert [(it["name"], it["arguments"]) for it in calls] == [
        (c.name, c.arguments) for c in parsed.calls
    ]
    # every item: added once, its deltas add up to its final text, done once with that item
    for index, item in enumerate(items):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added"
        assert mine[0]["item"]["id"] == item["id"]
        assert mine[-1] == {"type": "response.output_item.done", "output_index": index,
                            "item": item}  # fmt: skip
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        final = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert deltas == final and item["status"] == "completed"
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == list(range(len(items)))  # one item at a time, in order
    (message,) = output_messages(items)  # the next turn sees the reply as one chat message
    assert message["content"] == parsed.content
    assert [c["function"]["arguments"] for c in message.get("tool_calls", [])] == [
        c.arguments for c in parsed.calls
    ]


def test_items_follow_the_order_the_model_wrote_them():
    text = f"A{FORCED_CALL} mid {FORCED_CALL} end"
    items, _ = feed_reply(ChatReply(None, AutoToolCalls(HermesToolParser())), text,
                          range(1, len(text)))  # fmt: skip
    kinds = [it["type"] for it in items]
    assert kinds == ["message", "function_call", "message", "function_call", "message"]
    assert texts(items, "message") == ["A", " mid ", " end"]


def test_reasoning_tokens_count_up_to_the_end_tag():
    assert reasoning_tokens([5, 6, 99, 7], "thought", 99) == 3
    assert reasoning_tokens([5, 6, 7], "thought", 99) == 3  # still thinking
    assert reasoning_tokens([5, 6, 7], "", 99) == 0
    assert reasoning_tokens([5, 6, 7], "thought", None) == 0


def test_the_store_forgets_the_oldest_and_returns_copies():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    with pytest.raises(NotFound, match="r0"):
        store.get("r0")
    assert store.get("r2") == {"id": "r2"} and len(store) == 2
    store.conversation("r1")[0]["content"] = "changed"
    assert store.conversation("r1") == [{"role": "user", "content": "1"}]
    store.delete("r1")
    with pytest.raises(NotFound):
        store.delete("r1")
    off = ResponseStore(capacity=0)
    off.put({"id": "x"}, [])
    assert len(off) == 0
    with pytest.raises(ValueError):
        ResponseStore(capacity=-1)


class FakeGroup:
    """An engine request that writes "Hel" and then fails."""

    async def updates(self):
        out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "Hel", [7])], False)
        yield Update(0, output=out)
        yield Update(0, error=EngineUnavailable("the engine stopped"))


def test_a_stream_that_fails_ends_with_response_failed():
    req = request()
    choices = Choices([SamplingParams()], reply=ChatReply(None, None))
    run = ResponseRun("resp_x", MODEL, req, choices, input_messages(req.input))
    store = ResponseStore()

    async def collect():
        return [chunk async for chunk in _response_sse(FakeGroup(), run, store)]

    chunks = asyncio.run(collect())
    blocks = [block for chunk in chunks for block in chunk.split("\n\n") if block]
    events = [json.loads(block.split("data: ", 1)[1]) for block in blocks]
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error",
                                                 "response.failed"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["status"] == "failed" and len(store) == 0
    assert events[-1]["response"]["error"] == {"code": "engine_unavailable",
                                               "message": "the engine stopped"}  # fmt: skip


# ---- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    argv = [str(default_model_dir()), "--served-model-name", MODEL, "--max-model-len", "512",
            "--cpu-kv-cache-gib", "0.05", "--disable-log-stats", "--chat-template", TEMPLATE,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--max-stored-responses", "4"]  # fmt: skip
    srv = ServerThread(build(make_parser().parse_args(argv))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def respond(client, **kw):
    return client.responses.create(**{"model": MODEL, "input": "hi", "temperature": 0,
                                      "max_output_tokens": 8, **kw})  # fmt: skip


def streamed(client, **kw):
    """(event types, the final response) of a streamed response."""
    events = list(respond(client, stream=True, **kw))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    return [e.type for e in events], events[-1].response


def dump(response):
    """A response without what differs between two runs (ids, times)."""
    body = response.model_dump()
    for item in body["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
    return {k: v for k, v in body.items() if k not in ("id", "created_at", "completed_at")}


def prompt_tokens(server, messages, tools=None):
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(server.url + "/tokenize", json=body).json()["count"]


def test_text_whole_and_streamed_agree(client):
    r = respond(client)
    assert r.object == "response" and r.status == "incomplete" and r.output_text
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert [it.type for it in r.output] == ["message"] and r.output[0].status == "incomplete"
    types, final = streamed(client)
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert dump(final) == dump(r)


def test_instructions_and_previous_response_make_the_prompt(server, client):
    first = respond(client, instructions="Answer in French.", input="Hello")
    expected = [{"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hello"}]  # fmt: skip
    assert first.usage.input_tokens == prompt_tokens(server, expected)
    second = respond(client, input="And again?", previous_response_id=first.id)
    # the earlier turn and its reply, without the earlier instructions (as OpenAI does)
    history = [{"role": "user", "content": "Hello"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And again?"}]  # fmt: skip
    assert second.usage.input_tokens == prompt_tokens(server, history)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        respond(client, previous_response_id=first.id)
    unstored = respond(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    kept = [respond(client).id for _ in range(5)]  # --max-stored-responses 4
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept[0])
    assert client.responses.retrieve(kept[-1]).id == kept[-1]


def test_input_items_list_back_the_request_input(server, client):
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "hi"}], "id": "msg_mine"},
             {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "again"}]  # fmt: skip
    r = respond(client, input=items)
    listed = client.responses.input_items.list(r.id)  # newest first, as OpenAI lists them
    assert [it.role for it in listed.data] == ["user", "assistant", "user", "developer"]
    assert listed.data[2].id == "msg_mine" and all(it.id for it in listed.data)
    assert listed.data[1].content[0].type == "output_text"
    assert listed.data[0].content[0].text == "again"
    url = f"{server.url}/v1/responses/{r.id}/input_items"
    page = httpx.get(url, params={"order": "asc", "limit": 2}).json()
    assert [it["role"] for it in page["data"]] == ["developer", "user"] and page["has_more"]
    rest = httpx.get(url, params={"order": "asc", "after": page["last_id"]}).json()
    assert [it["role"] for it in rest["data"]] == ["assistant", "user"] and not rest["has_more"]
    for bad in ({"limit": "0"}, {"limit": "x"}, {"order": "up"}, {"after": "nope"}):
        assert httpx.get(url, params=bad).status_code == 400
    assert httpx.get(f"{server.url}/v1/responses/resp_nope/input_items").status_code == 404
    text = respond(client, input="just text")
    (only,) = client.responses.input_items.list(text.id).data
    assert (only.role, only.content[0].text) == ("user", "just text")


def test_named_and_required_tool_choices_give_function_calls(client):
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        one = {"parallel_tool_calls": False}  # "required" then closes its array after a call
        r = respond(client, tools=TOOLS, tool_choice=choice, max_output_tokens=120, **one)
        calls = [it for it in r.output if it.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1
        assert calls[0].name == "get_weather" and calls[0].status == "completed"
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
        types, final = streamed(client, tools=TOOLS, tool_choice=choice, max_output_tokens=120,
                                **one)  # fmt: skip
        assert "response.function_call_arguments.delta" in types
        assert types[-1] == "response.completed" and dump(final) == dump(r)


def test_auto_tool_calls_and_their_outputs_round_trip(server, client):
    force = {"structured_outputs": {"regex": "Checking\\. " + re.escape(FORCED_CALL)}}
    r = respond(client, tools=TOOLS, max_output_tokens=60, extra_body=force)
    assert [it.type for it in r.output] == ["message", "function_call"]
    assert r.output_text == "Checking. "
    call = r.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    # the call and its output go back as input items, and reach the prompt as chat messages
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    items = [{"role": "user", "content": "hi"}, call.model_dump(exclude_none=True), answer]
    after = respond(client, tools=TOOLS, input=items, tool_choice="none")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]  # fmt: skip
    assert after.usage.input_tokens == prompt_tokens(server, messages, CHAT_TOOLS)
    # previous_response_id carries the call too
    follow = respond(client, tools=TOOLS, tool_choice="none", previous_response_id=r.id,
                     input=[items[2]])  # fmt: skip
    messages[1]["content"] = "Checking. "
    assert follow.usage.input_tokens == prompt_tokens(server, messages, CHAT_TOOLS)


def test_json_schema_text_format_and_errors(client):
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": CITY}}
    with client.responses.stream(model=MODEL, input="hi", text=fmt, max_output_tokens=40) as s:
        final = s.get_final_response()  # the SDK's helper needs response.completed
    assert json.loads(final.output_text)["city"] in ("Paris", "Oslo")
    for bad, words in [({"background": True, "store": False}, "background"),
                       ({"tools": [{"type": "web_search"}]}, "only function tools"),
                       ({"tool_choice": "auto"}, "needs tools"),
                       ({"input": [{"type": "compaction"}]}, "item type")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=words):
            respond(client, **bad)
    with pytest.raises(openai.NotFoundError, match="model"):
        respond(client, model="other")


def test_background_responses_are_polled_and_cancelled(client, server):
    """background=true answers at once ("queued"); GET polls it to the same reply a plain
    request gets; /cancel aborts one still running (its engine request freed) and is refused for
    a response that was not a background one; an unfinished one cannot be continued."""
    want = respond(client, max_output_tokens=12)
    r = respond(client, max_output_tokens=12, background=True)
    assert r.status == "queued" and r.background
    for _ in range(600):
        got = client.responses.retrieve(r.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert got.status == want.status and got.output_text == want.output_text
    assert got.usage.output_tokens == want.usage.output_tokens
    assert client.responses.cancel(r.id).status == want.status  # finished: unchanged
    with pytest.raises(openai.BadRequestError, match="only background"):
        client.responses.cancel(want.id)
    long = respond(client, max_output_tokens=400, background=True,
                   extra_body={"ignore_eos": True})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="no reply to continue"):
        respond(client, previous_response_id=long.id)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == (
        "cancelled"
    )
    engine = server.server.config.app.state.engine.engine
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0
