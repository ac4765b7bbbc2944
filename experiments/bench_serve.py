"""Serving benchmark client in the style of ``vllm bench serve``, for any OpenAI-compatible URL.

Request lengths come from :mod:`paged_llm.workloads.lengths` (the synthetic ShareGPT fit, a
length CSV, or fixed lengths); arrivals are a Poisson process (``--burstiness 1``) or gamma
distributed at ``--request-rate``, optionally capped by ``--max-concurrency``. Every request
streams; the client times the first token, every later chunk and the end, and writes the
result JSON in vLLM's layout (same keys, same definitions), so numbers compare with vLLM's::

    python -m paged_llm.serve --model tiny --max-model-len 512 &
    python -m experiments.bench_serve --base-url http://127.0.0.1:8000 --model tiny \\
        --num-prompts 100 --request-rate 20 --save-result --result-dir outputs/bench

Prompts are random token ids by default (exact input lengths, any model, no tokenizer
needed); with ``--tokenizer DIR`` (a local directory) they are text of about the right length,
which the chat backend needs. Output lengths are enforced with ``max_tokens`` and
``ignore_eos`` (vLLM's extension; on by default since the workload defines the lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from paged_llm.workloads.lengths import (
    LengthPair,
    filter_total_below,
    load_length_csv,
    sample_pairs,
    scale_to_max_total,
    synthetic_lengths,
)

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
METRICS = ("ttft", "tpot", "itl", "e2el")
TEXT_MARGIN = 16  # tokens kept free for BOS / chat-template tokens around a text prompt


@dataclass
class BenchRequest:
    """One request of the workload."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str | None = None  # the LoRA adapter it names (--lora-modules); None: --model


@dataclass
class RequestResult:
    """What the client measured for one request (vLLM's RequestFuncOutput)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


# ---- workload -----------------------------------------------------------------------------------
def load_pairs(args: argparse.Namespace, max_total: int | None) -> list[LengthPair]:
    """num_prompts (input_len, output_len) pairs from the chosen dataset, fitted to max_total."""
    if args.dataset_name == "random":
        pool = [LengthPair(args.random_input_len, args.random_output_len)] * args.num_prompts
    elif args.dataset_name == "csv":
        if not args.dataset_path:
            raise ValueError("--dataset-name csv needs --dataset-path FILE.csv")
        pool = load_length_csv(args.dataset_path)
    else:  # more draws than needed, so filtering still leaves enough
        pool = synthetic_lengths(max(4 * args.num_prompts, 1000), seed=args.seed)
    if max_total is not None:
        if args.fit == "filter":
            pool = filter_total_below(pool, max_total + 1)  # keeps input + output <= max_total
        else:
            pool = scale_to_max_total(pool, max_total)
        if not pool:
            raise ValueError(f"no request of the dataset fits in {max_total} tokens")
    return sample_pairs(pool, args.num_prompts, seed=args.seed)


def build_requests(
    pairs: list[LengthPair], tokenizer: Any, seed: int, id_range: tuple[int, int]
) -> list[BenchRequest]:
    """Token-id prompts (exact lengths), or text prompts when a tokenizer is given."""
    rng = random.Random(seed)
    out = []
    for p in pairs:
        if tokenizer is None:
            ids = [rng.randrange(*id_range) for _ in range(p.input_len)]
            out.append(BenchRequest(ids, p.input_len, p.output_len))
        else:
            text, n = _text_of_length(tokenizer, p.input_len, rng)
            out.append(BenchRequest(text, n, p.output_len))
    return out


def assign_lora_modules(requests: list[BenchRequest], names: list[str] | None, seed: int) -> None:
    """vLLM's --lora-modules: each request names one of these adapters, drawn at random."""
    if not names:
        return
    rng = random.Random(seed + 1)  # not the prompts' stream: adding adapters keeps the prompts
    for req in requests:
        req.model = rng.choice(names)


def _text_of_length(tokenizer: Any, n: int, rng: random.Random) -> tuple[str, int]:
    """Random text that re-tokenizes to about n tokens (vLLM's random-dataset recipe)."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    ids = [rng.choice(vocab) for _ in range(n)]
    for _ in range(4):  # decode/encode round trips change the count a little; converge
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)[:n]
        ids += [rng.choice(vocab) for _ in range(n - len(ids))]
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start): gamma gaps of mean 1/rate (Poisson at burstiness 1),
    rescaled so the last is n / rate, as vLLM does; all zero at an infinite rate."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        times.append(t)
    scale = (n / rate) / times[-1] if times and times[-1] > 0 else 1.0
    return [x * scale for x in times]


# ---- one request --------------------------------------------------------------------------------
def request_body(args: argparse.Namespace, req: BenchRequest) -> dict[str, Any]:
    """The JSON body for one request (streaming, with usage reported at the end)."""
    body: dict[str, Any] = {
        "model": req.model or args.served_model_name or args.model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if args.logprobs is not None:
            body.update(logprobs=True, top_logprobs=args.logprobs)
    else:
        body["prompt"] = req.prompt
        if args.logprobs is not None:
            body["logprobs"] = args.logprobs
    for key in ("top_p", "top_k", "min_p"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body or {})
    return body


async def send_request(
    client: Any, url: str, headers: dict[str, str], body: dict[str, Any], prompt_len: int
) -> RequestResult:
    """Stream one request and time it the way vLLM's client does."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    result.start_time = start
    text: list[str] = []
    token_chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:500]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if not result.ttft:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    choice = chunk["choices"][0]
                    delta = choice.get("delta") or {}
                    text.append(choice.get("text") or delta.get("content") or "")
                    token_chunks += "role" not in delta  # a chat role chunk carries no token
                elif chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens") or 0
    except Exception as err:  # network errors count as failed requests, as in vLLM
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.generated_text = "".join(text)
    result.latency = last - start
    result.success = result.ttft > 0
    if not result.success:
        result.error = "no chunk with a token arrived"
    if not result.output_tokens:  # the server reported no usage: one token per chunk
        result.output_tokens = token_chunks
    return result


# ---- metrics ------------------------------------------------------------------------------------
def calculate_metrics(
    results: list[RequestResult], duration: float, percentiles: list[float], metrics: list[str]
) -> dict[str, Any]:
    """vLLM's result fields: counts, throughputs, and mean/median/std/pXX per latency metric."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        **_peaks(ok),
    }
    for name in metrics:
        values = np.asarray(samples[name] or [0.0]) * 1000.0
        out[f"mean_{name}_ms"] = float(np.mean(values))
        out[f"median_{name}_ms"] = float(np.median(values))
        out[f"std_{name}_ms"] = float(np.std(values))
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            out[f"p{word}_{name}_ms"] = float(np.percentile(values, p))
    return out


def _peaks(ok: list[RequestResult]) -> dict[str, float]:
    """Peak output tokens in any one-second bucket and the concurrency then (vLLM's fields)."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start_time for r in ok)
    n = int(math.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for r in ok:
        t = r.start_time + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            tokens[min(int(t - t0), n - 1)] += 1
        active[int(r.start_time - t0) : int(r.start_time + r.latency - t0) + 1] += 1
    return {
        "max_output_tokens_per_s": float(tokens.max()),
        "max_concurrent_requests": int(active.max()),
    }


# ---- the run ------------------------------------------------------------------------------------
async def _server_max_model_len(client: Any, base_url: str, headers: dict[str, str]) -> int | None:
    """vLLM and paged-llm report max_model_len in /v1/models; other servers may not."""
    with contextlib.suppress(Exception):
        resp = await client.get(f"{base_url}/v1/models", headers=headers)
        value = resp.json()["data"][0].get("max_model_len")
        return int(value) if value else None
    return None


async def _server_version(client: Any, base_url: str, headers: dict[str, str]) -> Any:
    """The server's /version (paged-llm's names its hardware); None where it has none."""
    with contextlib.suppress(Exception):
        resp = await client.get(f"{base_url}/version", headers=headers)
        resp.raise_for_status()
        return resp.json()
    return None


async def _wait_ready(client: Any, url: str, headers: dict, body: dict, timeout: float) -> None:
    """Send a test request until one succeeds (bounded by timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        result = await send_request(client, url, headers, body, 0)
        if result.success:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the endpoint is not ready: {result.error}")
        await asyncio.sleep(1.0)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark; return the result dict (vLLM's layout)."""
    import httpx

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    url = base_url + (args.endpoint or ENDPOINTS[args.backend])
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for item in args.header or []:
        key, _, value = item.partition("=")
        headers[key.strip()] = value.strip()
    tokenizer = _load_tokenizer(args.tokenizer)
    if args.backend == "openai-chat" and tokenizer is None:
        raise ValueError("the chat backend sends text: pass --tokenizer DIR to build prompts")
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        max_total = args.max_total_len
        if max_total is None:
            max_total = await _server_max_model_len(client, base_url, headers)
            if max_total is not None and tokenizer is not None:
                max_total -= TEXT_MARGIN
        pairs = load_pairs(args, max_total)
        requests = build_requests(
            pairs, tokenizer, args.seed, (args.token_id_low, args.token_id_high)
        )
        assign_lora_modules(requests, args.lora_modules, args.seed)
        if args.ready_check_timeout_sec > 0:
            first = requests[0]
            body = request_body(args, BenchRequest(first.prompt, first.prompt_len, 1))
            await _wait_ready(client, url, headers, body, args.ready_check_timeout_sec)
        times = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(req: BenchRequest, at: float, t0: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with gate or contextlib.nullcontext():
                return await send_request(
                    client, url, headers, request_body(args, req), req.prompt_len
                )

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r, at, t0) for r, at in zip(requests, times)))
        duration = time.perf_counter() - t0
        server = await _server_version(client, base_url, headers)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    result = _header(args, tokenizer)
    # provenance: real requests against a live server; its hardware is the one measured
    result.update(mode="real", server=server, client_hardware=client_hardware())
    result.update(
        calculate_metrics(results, duration, percentiles, args.percentile_metrics.split(","))
    )
    if args.save_detailed:
        result.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens if r.success else 0 for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results],
        )
    return result


def _load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    if not Path(path).expanduser().is_dir():
        raise ValueError(f"--tokenizer must be a local directory (nothing is downloaded): {path}")
    return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)


def client_hardware() -> dict[str, Any]:
    """The machine sending the requests (without importing torch)."""
    from paged_llm.metrics.run_info import cpu_name

    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "host": platform.node()}


def _header(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    header = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": args.model,
        "tokenizer_id": args.tokenizer,
        "num_prompts": args.num_prompts,
        "dataset_name": args.dataset_name,
        "seed": args.seed,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "lora_modules": args.lora_modules,
    }
    for item in args.metadata or []:
        key, _, value = item.partition("=")
        header[key.strip()] = value.strip()
    return header


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """vLLM's file name: {label}-{rate}qps[-concurrencyN]-{model}-{date}.json."""
    if args.result_filename:
        name = args.result_filename
    else:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        label = args.label or args.backend
        model = args.model.rstrip("/").split("/")[-1]
        name = f"{label}-{args.request_rate}qps{conc}-{model}-{result['date']}.json"
    return Path(args.result_dir or ".") / name


def print_summary(result: dict[str, Any]) -> None:
    """vLLM's console table."""
    print("{:=^50}".format(" Serving Benchmark Result "))
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    for name in METRICS:
        for key in (k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std")):
            rows.append(
                (f"{key.split('_')[0].capitalize()} {name.upper()} (ms):", f"{result[key]:.2f}")
            )
    for label, value in rows:
        print(f"{label:<40} {value!s:<10}")
    print("=" * 50)


def make_parser() -> argparse.ArgumentParser:
    """``vllm bench serve``'s flags (the subset that applies) plus the workload module's."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai")
    p.add_argument("--base-url", help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", help="API path (default by backend)")
    p.add_argument("--header", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--api-key", help="bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--model", required=True, help="model name sent in requests")
    p.add_argument("--served-model-name", help="if different from --model")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME",
        help="LoRA adapters the server serves (its --lora-modules names); each request names one "
        "at random (vLLM's)",
    )
    p.add_argument("--tokenizer", help="local tokenizer directory: send text prompts")
    p.add_argument("--label")
    p.add_argument(
        "--dataset-name",
        choices=["synthetic-sharegpt", "csv", "random"],
        default="synthetic-sharegpt",
    )
    p.add_argument("--dataset-path", help="CSV with input_len,output_len columns")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--max-total-len",
        type=int,
        help="fit input+output lengths into this (default: the server's max_model_len)",
    )
    p.add_argument(
        "--fit",
        choices=["filter", "scale"],
        default="filter",
        help="drop pairs that do not fit (the paper's rule) or shrink them",
    )
    p.add_argument("--token-id-low", type=int, default=10)
    p.add_argument("--token-id-high", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 is Poisson, <1 burstier, >1 more regular",
    )
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--logprobs", type=int)
    p.add_argument("--extra-body", type=json.loads)
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0)
    p.add_argument("--ready-check-timeout-sec", type=float, default=60.0)
    p.add_argument("--percentile-metrics", default=",".join(METRICS))
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true")
    p.add_argument("--result-dir")
    p.add_argument("--result-filename")
    p.add_argument("--metadata", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--quiet", action="store_true", help="no console table")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run from the command line; return the result dict (also written with --save-result)."""
    args = make_parser().parse_args(argv)
    bad = [m for m in args.percentile_metrics.split(",") if m not in METRICS]
    if bad:
        raise SystemExit(f"--percentile-metrics: unknown {bad}; choose from {list(METRICS)}")
    result = asyncio.run(run_benchmark(args))
    if not args.quiet:
        print_summary(result)
    if args.save_result or args.result_filename:
        path = result_path(args, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        if not args.quiet:
            print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
