"""vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1): sleep mode over HTTP (``/sleep``,
``/wake_up``, ``/is_sleeping``, the ``vllm:engine_sleep_state`` gauge) and ``/collective_rpc``.
Requests that arrive while the engine sleeps get a 503 and leave nothing behind; after waking,
the same request gives the same text."""

import contextlib

import httpx
from test_serve_api import start_server

from paged_llm.models.presets import default_model_dir
from paged_llm.serve.metrics import parse_metrics

KEY = {"Authorization": "Bearer k"}
BODY = {"model": "tiny-chat", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}  # fmt: skip


@contextlib.contextmanager
def serving(*flags):
    srv = start_server(default_model_dir(), *flags)
    try:
        yield srv
    finally:
        srv.stop()


def sleep_state(srv) -> dict[str, float]:
    metrics = parse_metrics(httpx.get(srv.url + "/metrics").text)
    return {name.split('sleep_state="')[1][:-2]: v for name, v in metrics.items()
            if name.startswith("vllm:engine_sleep_state")}  # fmt: skip


def test_without_dev_mode_there_are_no_sleep_routes(monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with serving("--enable-sleep-mode") as srv:
        for route in ("/sleep", "/wake_up", "/collective_rpc"):
            assert httpx.post(srv.url + route).status_code == 404
        assert httpx.get(srv.url + "/is_sleeping").status_code == 404


def test_sleep_wake_up_and_collective_rpc_over_http(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with serving("--enable-sleep-mode", "--api-key", "k") as srv:

        def post(route, **kw):
            return httpx.post(srv.url + route, headers=KEY, timeout=60, **kw)

        def is_sleeping():
            r = httpx.get(srv.url + "/is_sleeping", headers=KEY)
            assert r.status_code == 200
            return r.json()["is_sleeping"]

        assert httpx.post(srv.url + "/sleep").status_code == 401  # the API key guards them
        first = post("/v1/completions", json=BODY)
        assert first.status_code == 200
        assert not is_sleeping() and sleep_state(srv) == {
            "awake": 1, "weights_offloaded": 0, "discard_all": 0
        }  # fmt: skip
        r = post("/collective_rpc", json={"method": "apply_model", "args": []})
        assert r.status_code == 400 and "func" in r.json()["error"]["message"]
        r = post("/collective_rpc", json={"method": "nope"})
        assert r.status_code == 400 and "no public method 'nope'" in r.text
        assert post("/sleep", params={"level": 3}).status_code == 400

        engine = srv.server.config.app.state.engine.engine
        monkeypatch.setattr(engine, "has_unfinished_requests", lambda: True)
        assert post("/sleep").status_code == 409  # not while requests run
        monkeypatch.undo()
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")

        assert post("/sleep", params={"level": 1}).status_code == 200
        assert is_sleeping() and sleep_state(srv)["weights_offloaded"] == 1
        r = post("/v1/completions", json=BODY)
        assert r.status_code == 503 and "wake_up" in r.json()["error"]["message"]
        assert post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert is_sleeping()  # the KV cache still sleeps
        assert post("/wake_up", params={"tags": "bogus"}).status_code == 400
        assert post("/wake_up").status_code == 200
        assert not is_sleeping() and sleep_state(srv)["awake"] == 1
        again = post("/v1/completions", json=BODY)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert not engine.has_unfinished_requests()
