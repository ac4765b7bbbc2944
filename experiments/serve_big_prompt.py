"""One huge prompt against a live ``python -m paged_llm.serve`` process: how long its refusal
takes, whether a small completion sent at the same moment still completes (and how long it
takes, beside the same small request sent alone: the peer), and how much the server's memory
grows (resident set after, and peak, from /proc). Per server body limit (``body_limit_mb``,
one server process each): the huge prompt (413 while reading when it is over the limit, else a
400 from its length alone) and a prompt under the limit that cannot fit the context (a 400 from
its length alone).

    python -m experiments.serve_big_prompt [checkpoint=tiny] [prompt_mb=50] [under_limit_mb=8]
        [body_limit_mb=[16,64]]    # configs/serve_big_prompt.yaml; JSON in the run directory
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from experiments.common.cli import hydra_app, settings
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


def _raw_post(host: str, port: int, path: str, body: bytes) -> dict[str, Any]:
    """POST ``body`` over a plain socket, sending it in 1 MiB pieces and stopping as soon as
    the server answers (an HTTP client sends the whole body first, which would time the
    client): the status and the seconds from the first byte sent to the status line."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((host, port), timeout=120) as sock:
        start = time.monotonic()
        sock.sendall(head)
        sent, answer = 0, b""
        while b"\r\n" not in answer:
            writing = [sock] if sent < len(body) else []
            readable, writable, _ = select.select([sock], writing, [], 120)
            if readable:
                piece = sock.recv(65536)
                if not piece:
                    break
                answer += piece
            elif writable:
                try:
                    sent += sock.send(memoryview(body)[sent : sent + 2**20])
                except OSError:  # the server closed the connection: its answer may follow
                    sent = len(body)
            else:
                break  # no answer within 120 s
        seconds = time.monotonic() - start
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            while piece := sock.recv(65536):
                answer += piece
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    out: dict[str, Any] = {"status": status, "seconds": round(seconds, 4),
                           "body_sent_mib": round(min(sent, len(body)) / 2**20, 1)}  # fmt: skip
    _, _, payload = answer.partition(b"\r\n\r\n")
    with contextlib.suppress(ValueError, KeyError):
        out["error"] = json.loads(payload)["error"]["message"][:200]
    return out


def huge_body(megabytes: float) -> bytes:
    """A completion request whose prompt is ``megabytes`` MiB of text."""
    return b'{"prompt": "' + b"a" * int(megabytes * 2**20) + b'", "max_tokens": 4}'


def measure(url: str, pid: int, body: bytes) -> dict[str, Any]:
    """Send ``body`` and a small completion at the same moment; both answers, and the memory."""
    parsed = urlsplit(url)
    host, port, path = parsed.hostname, parsed.port, parsed.path
    small = json.dumps(SMALL).encode()
    before = _memory_kib(pid)
    peak_reset = _reset_peak(pid)
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda: results.update(huge=_raw_post(host, port, path, body))),
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
        body_limit_mb: float, repeats: int = 3) -> dict[str, Any]:  # fmt: skip
    """Start a server process, measure both huge prompts and the small request alone."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "paged_llm.serve", "--model", model, "--port", str(port),
           "--disable-log-stats", "--uvicorn-log-level", "warning",
           "--max-request-body-bytes", str(int(body_limit_mb * 2**20))]  # fmt: skip
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
        "body_limit_mib": body_limit_mb,
        "small_request_alone_seconds_median": round(statistics.median(alone), 4),
        "huge_prompt": over,
        "under_body_limit_too_long": under,
        "health_after": healthy,
    }


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run the measurement with the config's settings; write serve_big_prompt.json into
    out_dir; return it."""
    args = settings(cfg)
    if any(args.under_limit_mb >= limit for limit in args.body_limit_mb):
        raise ValueError("under_limit_mb must be under every body_limit_mb")
    runs = [run(args.checkpoint, args.prompt_mb, args.under_limit_mb, args.max_model_len, limit)
            for limit in args.body_limit_mb]  # fmt: skip
    doc = {**run_info("real"), "model": args.checkpoint, "prompt_mib": args.prompt_mb, "runs": runs}
    path = write_json(out_dir, "serve_big_prompt.json", doc)
    print(f"wrote {path}")
    for r in runs:
        print(f"body limit {r['body_limit_mib']} MiB:", {k: r[k] for k in
              ("huge_prompt", "under_body_limit_too_long")})  # fmt: skip
        print("  small request alone (median s):", r["small_request_alone_seconds_median"])
    return doc


def main() -> None:
    """``python -m experiments.serve_big_prompt [key=value ...]`` (its config in configs/)."""
    hydra_app("serve_big_prompt", write)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
