"""Server limits on loopback: API key (401), the bounded waiting queue (429), and the clear
error for chat on a checkpoint without a chat template (a renderer test). One in-process server
that runs one sequence at a time (--max-num-seqs 1), so queued requests stay queued."""

import asyncio
import json

import httpx
import openai
import pytest

from paged_llm.engine.loading import load_tokenizer
from paged_llm.models.presets import default_model_dir
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser
from paged_llm.serve.errors import BadRequest
from paged_llm.serve.prompts import chat_prompt

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    argv = ["--model", "tiny", "--max-model-len", "256", "--cpu-kv-cache-gib", "0.02"]
    argv += ["--api-key", KEY, "--max-waiting", "2", "--max-num-seqs", "1", "--disable-log-stats"]
    srv = ServerThread(build(make_parser().parse_args(argv))).start()
    yield srv
    srv.stop()


def test_api_key_required_on_v1_routes_only(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens


def test_chat_without_template_is_a_clear_400():
    # the built-in models ship a template; a checkpoint without one gets this 400
    tokenizer = load_tokenizer(default_model_dir())
    tokenizer.chat_template = None
    render = chat_prompt([{"role": "user", "content": "hi"}], None)
    with pytest.raises(BadRequest, match="no chat template.*--chat-template") as err:
        render(tokenizer)
    assert err.value.status_code == 400 and err.value.param == "messages"


def test_waiting_queue_is_bounded(server):
    url = server.url + "/v1/completions"

    def body(max_tokens):
        return {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    async def first_event(lines):
        # manual anext: abandoning an `async for` over the response would close it (hang up)
        while not (line := await anext(lines)).startswith("data:"):
            pass
        return line

    async def read_all(response):
        tokens = 0
        async for line in response.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                tokens += bool(json.loads(line[5:])["choices"])
        return tokens

    async def run():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:

            async def open_stream(max_tokens):
                return await http.send(
                    http.build_request("POST", url, json=body(max_tokens)), stream=True
                )

            # A runs (it has produced a token), so it no longer counts as waiting
            a = await open_stream(200)
            a_lines = a.aiter_lines()  # keep it referenced: a collected iterator hangs up
            assert a.status_code == 200 and await first_event(a_lines)
            # B and C fill the queue of 2: the engine runs one sequence at a time
            b, c = await open_stream(3), await open_stream(3)
            assert b.status_code == c.status_code == 200
            d = await http.post(url, json={"prompt": "x", "max_tokens": 2})
            assert d.status_code == 429
            assert d.json()["error"]["type"] == "rate_limit_error"
            # B's client hangs up while B is still queued: its place is freed for E
            await b.aclose()
            for _ in range(100):
                e = await open_stream(3)
                if e.status_code == 200:
                    break
                await e.aclose()
                await asyncio.sleep(0.02)  # the server notices the hang-up asynchronously
            assert e.status_code == 200
            await a.aclose()  # A's client hangs up: A is aborted, C and E run
            assert await read_all(c) == 3 and await read_all(e) == 3
            await c.aclose()
            await e.aclose()

    asyncio.run(run())
