"""The serve command line: vLLM's flags map onto EngineConfig, unsupported ones fail fast, and
SIGTERM shuts a real server process down gracefully (in-flight stream finishes, exit 0)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from paged_llm.config import EngineConfig
from paged_llm.serve.cli import engine_accepts, engine_kwargs, main, make_parser


def kwargs_of(*argv):
    return engine_kwargs(make_parser().parse_args(list(argv)))


def test_vllm_flags_map_to_engine_config():
    kw = kwargs_of(
        "--model", "tiny", "--block-size", "8", "--max-model-len", "128", "--max-num-seqs", "4",
        "--gpu-memory-utilization", "0.5", "--cpu-kv-cache-gib", "0.01", "--dtype", "float32",
        "--enable-chunked-prefill", "--max-num-batched-tokens", "64", "--seed", "3",
        "--trust-remote-code", "--enforce-eager", "-tp", "1",
    )  # fmt: skip
    cfg = EngineConfig.from_kwargs(**kw)
    assert (cfg.model.model, cfg.model.max_model_len, cfg.model.seed) == ("tiny", 128, 3)
    assert (cfg.cache.block_size, cfg.cache.gpu_memory_utilization) == (8, 0.5)
    assert cfg.scheduler.max_num_seqs == 4 and cfg.scheduler.enable_chunked_prefill
    assert kwargs_of("some/dir")["model"] == "some/dir"  # vLLM's positional model


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-parallel-size", "2"],
        ["--quantization", "awq"],
        ["--kv-cache-dtype", "fp8"],
        ["a", "--model", "b"],
        ["--max-waiting", "-1"],
    ],
)
def test_unsupported_flags_fail_before_loading(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    ("argv", "key", "value"),
    [
        (["--enable-prefix-caching"], "enable_prefix_caching", True),
        (["--speculative-config", json.dumps(SPEC)], "speculative_config", SPEC),
    ],
)
def test_engine_features_pass_through_once_the_engine_has_them(argv, key, value, capsys):
    if engine_accepts(key, value):
        assert kwargs_of(*argv)[key] == value
    else:  # not in EngineConfig yet: refused at startup, not silently ignored
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "not supported by the engine yet" in capsys.readouterr().err


def test_defaults_are_accepted():
    kw = kwargs_of("--no-enable-prefix-caching")
    assert kw["model"] == "tiny" and "enable_prefix_caching" not in kw


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url, proc, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


def test_sigterm_finishes_in_flight_stream_and_exits_zero():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "paged_llm.serve", "--model", "tiny", "--port", str(port)]
    cmd += ["--max-model-len", "256", "--cpu-kv-cache-gib", "0.02", "--disable-log-stats"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
    )
    try:
        _wait_healthy(url, proc)
        body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
        tokens = 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                if tokens == 0:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                if line == "data: [DONE]":
                    break
                tokens += 1
        assert tokens == 40  # the in-flight request was allowed to finish
        assert proc.wait(timeout=20) == 0
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
