"""The serve command line: vLLM's flags map onto EngineConfig (speculative decoding, prefix
caching, quantization, KV cache dtype included), bad or unsupported ones fail fast, and
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
import torch

from paged_llm.config import EngineConfig
from paged_llm.serve.background import ServerThread
from paged_llm.serve.cli import build, engine_kwargs, main, make_parser


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


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
TRANSFER = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": "/kv"}}  # fmt: skip


def test_engine_features_pass_through():
    kw = kwargs_of(
        "--enable-prefix-caching", "--speculative-config", json.dumps(SPEC),
        "-q", "int8", "--kv-cache-dtype", "fp8_e4m3", "--kv-offloading-size", "2.5",
        "--enable-sleep-mode", "--kv-transfer-config", json.dumps(TRANSFER),
    )  # fmt: skip
    cfg = EngineConfig.from_kwargs(**kw)
    assert cfg.cache.enable_prefix_caching and cfg.speculative_config == SPEC
    assert cfg.kv_transfer_config.kv_role == "kv_producer"
    assert cfg.kv_transfer_config.kv_connector_extra_config == {"shared_storage_path": "/kv"}
    assert cfg.cache.kv_offloading_size == 2.5 and cfg.model.enable_sleep_mode
    assert cfg.model.quantization == "int8" and cfg.cache.kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig.from_kwargs(**kwargs_of("--async-scheduling")).scheduler.async_scheduling
    assert not EngineConfig.from_kwargs(**kwargs_of()).scheduler.async_scheduling
    cfg = EngineConfig.from_kwargs(
        **kwargs_of("-tp", "2", "--enforce-eager", "--enable-expert-parallel")
    )
    assert cfg.model.tensor_parallel_size == 2 and cfg.model.enforce_eager
    assert cfg.model.enable_expert_parallel
    kw = kwargs_of("--generation-config", "vllm", "--override-generation-config", '{"top_k": 5}')
    cfg = EngineConfig.from_kwargs(**kw)
    assert (cfg.model.generation_config, cfg.model.override_generation_config) == (
        "vllm",
        {"top_k": 5},
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pipeline-parallel-size", "2"], "tensor parallelism only"),
        (["--quantization", "bnb"], "unknown method 'bnb'"),
        (["--kv-cache-dtype", "fp8_e5m2"], "unknown dtype 'fp8_e5m2'"),
        (["--speculative-config", "{not json"], "not valid JSON"),
        (["--speculative-config", "[3]"], "expected a JSON object"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
        (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
         "unknown speculative method"),
        (["--speculative-config", '{"num_speculative_tokens": 2, "lookup": 3}'], "lookup"),
        (["a", "--model", "b"], "model given twice"),
        (["--max-waiting", "-1"], "--max-waiting"),
        (["--override-generation-config", "{not json"], "not valid JSON"),
        (["--override-generation-config", '{"top_p": 0}'], "top_p"),
        (["--kv-transfer-config", '{"kv_connector": "Nccl"}'], "unknown KV connector 'Nccl'"),
        (["--kv-transfer-config", '{"kv_connector": "SharedStorageConnector", "kv_role": "p"}'],
         "unknown kv_role 'p'"),
    ],
)  # fmt: skip
def test_bad_or_unsupported_flags_fail_before_loading(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


def test_defaults_are_accepted():
    kw = kwargs_of("--no-enable-prefix-caching", "--kv-cache-dtype", "auto")
    assert kw["model"] == "tiny"
    for key in (
        "enable_prefix_caching",
        "speculative_config",
        "quantization",
        "kv_cache_dtype",
        "kv_transfer_config",
    ):
        assert key not in kw  # left to the engine's defaults


def test_int8_kv_cache_serves_tokens():
    argv = ["--model", "tiny", "--kv-cache-dtype", "int8", "--max-model-len", "128"]
    argv += ["--cpu-kv-cache-gib", "0.01", "--disable-log-stats"]
    with ServerThread(build(make_parser().parse_args(argv))) as srv:
        engine = srv.server.config.app.state.engine.engine
        caches = [t for layer in engine.runner.kv_caches for t in layer]  # (K, V) per layer
        assert engine.runner.kv_spec.quantized and all(t.dtype == torch.int8 for t in caches)
        body = {"prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


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
