"""No request gets a 5xx: thousands of generated bodies and headers per route against the ASGI
app (no sockets), then a normal request is still answered.

Bodies are any JSON, mutations of a valid request (fields set to any JSON value, required ones
dropped), raw bytes, and deep nests; headers are assorted content types and stray values. The
context is 32 tokens, so a generated request that is valid generates at most a few tokens."""

import asyncio
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.serve.cli import build, make_parser

EXAMPLES = 2000  # per route (the bar)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-3, 40),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.sampled_from(["yes", "true", "1", "auto", "none", "required", "text", "json_object"]),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)  # fmt: skip
_MESSAGES = [{"role": "user", "content": "def f"}]
# route: (a valid body that generates one token, the fields worth mutating)
ROUTES = {
    "/v1/completions": (
        {"prompt": "def f", "max_tokens": 1},
        ["prompt", "max_tokens", "n", "best_of", "stream", "stream_options", "temperature",
         "top_p", "top_k", "seed", "stop", "logprobs", "echo", "logit_bias", "use_beam_search",
         "structured_outputs", "guided_choice", "prompt_logprobs", "min_tokens", "ignore_eos",
         "truncate_prompt_tokens", "bad_words", "allowed_token_ids", "model"],
    ),
    "/v1/chat/completions": (
        {"messages": _MESSAGES, "max_tokens": 1},
        ["messages", "max_tokens", "max_completion_tokens", "n", "stream", "tools",
         "tool_choice", "response_format", "logprobs", "top_logprobs", "seed", "stop",
         "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
         "parallel_tool_calls", "use_beam_search", "return_token_ids"],
    ),
    "/v1/responses": (
        {"input": "def f", "max_output_tokens": 1},
        ["input", "instructions", "max_output_tokens", "stream", "tools", "tool_choice",
         "text", "reasoning", "previous_response_id", "store", "background", "truncation"],
    ),
    "/tokenize": ({"prompt": "def f"}, ["prompt", "messages", "add_special_tokens", "tools"]),
    "/detokenize": ({"tokens": [1, 5, 9]}, ["tokens", "model"]),
}  # fmt: skip
_CONTENT_TYPES = st.one_of(
    st.sampled_from(["application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
                     "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                     "application/jsonx", ""]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
    st.none(),
)  # fmt: skip
_HEADER_VALUES = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)


@st.composite
def _mutated(draw, route):
    """The route's valid body with some fields set to any JSON value or dropped."""
    body, fields = ROUTES[route]
    body = dict(body)
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()) and name in body:
            del body[name]
        else:
            body[name] = draw(_json)
    return json.dumps(body).encode()


def _nested(depth: int, kind: str) -> bytes:
    return ({"list": "[" * depth + "]" * depth,
             "object": '{"a":' * depth + "1" + "}" * depth,
             "field": '{"prompt": "x", "stop": ' + "[" * depth + "]" * depth + "}"}
            [kind]).encode()  # fmt: skip


def _bodies(route):
    return st.one_of(
        _mutated(route),
        _mutated(route),
        _json.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.builds(_nested, st.sampled_from([50, 65, 900, 5000, 100_000]),
                  st.sampled_from(["list", "object", "field"])),
    )  # fmt: skip


def _headers():
    return st.fixed_dictionaries(
        {},
        optional={"content-type": _CONTENT_TYPES, "authorization": _HEADER_VALUES,
                  "accept": _HEADER_VALUES, "x-request-id": _HEADER_VALUES},
    )  # fmt: skip


@pytest.fixture(scope="module")
def asgi():
    """(call, client): the app on its own event loop thread, and an ASGI client for it."""
    argv = ["--model", "tiny", "--max-model-len", "32", "--cpu-kv-cache-gib", "0.02",
            "--disable-log-stats", "--max-num-seqs", "16"]  # fmt: skip
    app = build(make_parser().parse_args(argv))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="asgi-loop", daemon=True)
    thread.start()

    def call(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def start():
        app.state.engine.start()
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

    client = call(start())
    yield call, client
    call(client.aclose())
    call(app.state.engine.shutdown(timeout=10))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_request_gets_a_5xx(asgi, route):
    call, client = asgi
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              database=None, derandomize=True)  # fmt: skip
    @given(body=_bodies(route), headers=_headers())
    def one(body, headers):
        headers = {k: v for k, v in headers.items() if v is not None}
        r = call(client.post(route, content=body, headers=headers))
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text[:300], body[:200], headers)
        if r.status_code >= 400:  # every refusal has OpenAI's error shape
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]

    one()
    assert sum(seen.values()) >= EXAMPLES
    # the generated mix reaches work, not only refusals: some are answered, some refused
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen)
    # afterwards the server still answers a normal request
    ok, _ = ROUTES[route]
    r = call(client.post(route, json=ok))
    assert r.status_code == 200, r.text
    assert call(client.get("/health")).status_code == 200
