"""Disaggregated serving over HTTP: a prefill server (kv_producer), a decode server (kv_consumer)
and ``paged_llm.serve.disagg_proxy`` in front of them; the official client talks to the proxy
and gets the tokens an ordinary engine generates, streamed or not, while the decode server
loads the prompts' KV instead of computing it."""

import json
import socket

import httpx
import openai
import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, make_parser
from paged_llm.serve.disagg_proxy import build_app, prefill_body

PROMPT = "import os\nimport sys\n\n" * 12  # several full 16-token blocks
COMMON = ["--model", "tiny", "--max-model-len", "256", "--cpu-kv-cache-gib", "0.01",
          "--disable-log-stats"]  # fmt: skip


def server(store, role: str) -> ServerThread:
    transfer = {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}  # fmt: skip
    argv = [*COMMON, "--kv-transfer-config", json.dumps(transfer)]
    return ServerThread(build(make_parser().parse_args(argv)))


def connector(srv: ServerThread):
    return srv.server.config.app.state.engine.engine.kv_connector


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    store = tmp_path_factory.mktemp("kv")
    prefill, decode = server(store, "kv_producer"), server(store, "kv_consumer")
    with prefill, decode, ServerThread(build_app([prefill.url], [decode.url])) as proxy:
        yield prefill, decode, proxy


def test_the_proxy_returns_the_tokens_of_an_ordinary_engine(servers):
    prefill, decode, proxy = servers
    want = LLM("tiny", max_model_len=256).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")
    loaded = connector(decode).num_loaded
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == 12  # the decode server's answer, not the prefill's
    full_blocks = (len(want.prompt_token_ids) - 1) // 16
    assert connector(prefill).num_saved >= full_blocks
    assert connector(decode).num_loaded - loaded == full_blocks
    # streamed: the pieces add up to the whole reply
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.outputs[0].text
    assert (
        metric(prefill, "paged_llm:kv_transfer_saved_blocks_total") == connector(prefill).num_saved
    )
    assert (
        metric(decode, "paged_llm:kv_transfer_loaded_blocks_total") == connector(decode).num_loaded
    )
    assert metric(decode, "paged_llm:kv_transfer_loaded_bytes_total") > 0
    assert httpx.get(proxy.url + "/health").status_code == 200
    assert httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"] == "tiny"


def metric(srv: ServerThread, name: str) -> float:
    """The value of an unlabelled-name metric line in ``/metrics`` (its first sample)."""
    lines = httpx.get(srv.url + "/metrics").text.splitlines()
    return float(next(line for line in lines if line.startswith(name)).split()[-1])


def prompt_tokens_total(srv: ServerThread) -> str:
    lines = httpx.get(srv.url + "/metrics").text.splitlines()
    return next(line for line in lines if line.startswith("vllm:prompt_tokens_total"))


def test_a_refused_prompt_is_answered_by_the_prefill_server_alone(servers):
    _, decode, proxy = servers
    before = prompt_tokens_total(decode)
    r = httpx.post(proxy.url + "/v1/completions",
                   json={"model": "tiny", "prompt": PROMPT * 10, "max_tokens": 4})  # fmt: skip
    assert r.status_code == 400 and "maximum context length is 256" in r.text
    assert prompt_tokens_total(decode) == before  # never sent on
    for bad in (b"[1, 2]", b"{not json"):
        r = httpx.post(proxy.url + "/v1/completions", content=bad,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and "JSON object" in r.text


def test_the_prefill_request_computes_the_prompt_only():
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 2, "min_tokens": 5,
            "max_completion_tokens": 50, "temperature": 0.7}  # fmt: skip
    assert prefill_body(body) == {"model": "m", "prompt": "x", "max_tokens": 1, "n": 1,
                                  "stream": False, "max_completion_tokens": 1,
                                  "temperature": 0.7}  # fmt: skip
    with pytest.raises(ValueError, match="at least one prefill"):
        build_app([], ["http://x"])


def test_a_server_that_is_down_is_a_502_not_a_crash(servers):
    prefill, _, _ = servers
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with ServerThread(build_app([prefill.url], [dead])) as proxy:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 502 and "cannot reach" in r.json()["error"]["message"]
        assert httpx.get(proxy.url + "/health").status_code == 503
