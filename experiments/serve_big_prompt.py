"""One huge prompt against a live ``python -m paged_llm.serve`` process: how long its refusal
takes, whether a small completion sent at the same moment still completes (and how long it
takes, beside the same small request sent alone: the peer), and how much the server's memory
grows (resident set after, and peak, from /proc). Two huge prompts: one over the body limit
(413 while reading) and one under it that cannot fit the context (400 from its length alone).

    python -m experiments.serve_big_prompt [--model tiny] [--prompt-mb 50] [--under-limit-mb 8]
        [--out outputs/serve_big_prompt]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from paged_llm.metrics.run_info import run_info, write_json

SMALL = {"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_kib(pid: int) -> dict[str, int]:
    """The process's resident set now (VmRSS) and its peak since the last reset (VmHWM)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current resident set (Linux: 5 > clear_refs); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError("the server did not become healthy")


def _timed_post(url: str, content: bytes) -> dict[str, Any]:
    """POST a JSON body; its status, the error message (if any) and seconds to the answer."""
    start = time.monotonic()
    r = httpx.post(url, content=content, headers={"Content-Type": "application/json"},
                   timeout=120)  # fmt: skip
    seconds = time.monotonic() - start
    out: dict[str, Any] = {"status": r.status_code, "seconds": round(seconds, 4)}
    if r.status_code >= 400:
        out["error"] = r.json()["error"]["message"][:200]
    return out


def huge_body(megabytes: float) -> bytes:
    """A completion request whose prompt is ``megabytes`` MiB of text."""
    return b'{"prompt": "' + b"a" * int(megabytes * 2**20) + b'", "max_tokens": 4}'


def measure(url: str, pid: int, body: bytes) -> dict[str, Any]:
    """Send ``body`` and a small completion at the same moment; both answers, and the memory."""
    import json

    small = json.dumps(SMALL).encode()
    before = _memory_kib(pid)
    peak_reset = _reset_peak(pid)
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda: results.update(huge=_timed_post(url, body))),
        threading.Thread(target=lambda: results.update(small=_timed_post(url, small))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = _memory_kib(pid)
    results["body_mib"] = round(len(body) / 2**20, 2)
    results["rss_growth_mib"] = round((after["VmRSS"] - before["VmRSS"]) / 1024, 1)
    if peak_reset:
        results["peak_growth_mib"] = round((after["VmHWM"] - before["VmRSS"]) / 1024, 1)
    return results


def run(model: str, prompt_mb: float, under_limit_mb: float, max_model_len: int | None,
        repeats: int = 3) -> dict[str, Any]:  # fmt: skip
    """Start a server process, measure both huge prompts and the small request alone."""
    import json

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "paged_llm.serve", "--model", model, "--port", str(port),
           "--disable-log-stats", "--uvicorn-log-level", "warning"]  # fmt: skip
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, proc)
        endpoint = url + "/v1/completions"
        small = json.dumps(SMALL).encode()
        _timed_post(endpoint, small)  # warm-up
        alone = [_timed_post(endpoint, small)["seconds"] for _ in range(repeats)]
        over = measure(endpoint, proc.pid, huge_body(prompt_mb))
        under = measure(endpoint, proc.pid, huge_body(under_limit_mb))
        healthy = httpx.get(url + "/health", timeout=5).status_code
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "server_command": " ".join(cmd[1:]),
        "small_request_alone_seconds_median": round(statistics.median(alone), 4),
        "over_body_limit": over,
        "under_body_limit_too_long": under,
        "health_after": healthy,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the measurement; write serve_big_prompt.json; return it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt-mb", type=float, default=50.0, help="MiB, over the body limit")
    p.add_argument("--under-limit-mb", type=float, default=8.0,
                   help="MiB, under the 16 MiB body limit but beyond the context")  # fmt: skip
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--out", default="outputs/serve_big_prompt")
    args = p.parse_args(argv)
    doc = {**run_info("real"), "model": args.model,
           **run(args.model, args.prompt_mb, args.under_limit_mb, args.max_model_len)}  # fmt: skip
    path = write_json(args.out, "serve_big_prompt.json", doc)
    print(f"wrote {path}")
    for key in ("over_body_limit", "under_body_limit_too_long"):
        print(key, doc[key])
    print("small request alone (median s):", doc["small_request_alone_seconds_median"])
    return doc


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
