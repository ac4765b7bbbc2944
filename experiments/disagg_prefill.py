"""Disaggregated prefill (DistServe, Splitwise; vLLM's ``kv_transfer_config``) against colocated
serving, with real engines on the same CPU cores.

A colocated engine runs prompts and decodes in one batch: with prefill-first scheduling (vLLM
V0's), a long prompt stalls every running decode for a whole prefill step, and its decodes see
that stall as one long inter-token gap; chunked prefill bounds the stall by splitting prompts.
Disaggregated, a prefill engine computes each prompt (and one token), its connector saves the
prompt's KV blocks, and a decode engine in another process loads them and decodes: its steps
are never interrupted by a prompt, at the cost of the transfer and of a prefill engine with
half the cores. The same Poisson trace of requests runs through three systems:

- ``colocated``: one engine process with every thread (prefill-first);
- ``colocated, chunked prefill``: the same engine with ``enable_chunked_prefill``;
- ``disaggregated``: a ``kv_producer`` process and a ``kv_consumer`` process, half the threads
  each, handing requests over through a queue and KV through ``SharedStorageConnector`` on a
  RAM disk (``/dev/shm`` where there is one).

Reported per system: TTFT (arrival to the first token the client sees), TPOT, inter-token
latency (ITL, where prefill interference shows), end-to-end latency, and for the disaggregated
one the KV bytes and seconds moved; and whether every request's tokens equal the colocated
engine's (greedy, fixed lengths).

    python -m experiments.disagg_prefill [checkpoint=opt-125m] [requests=16] [rate=0.5]
        [prompt=256] [output=48] [threads=2] [chunk=64]    # JSON in the Hydra run directory
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from experiments.common.cli import hydra_app, settings
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.metrics.serving import RequestRecord, latency_summary

DONE = "done"  # the prefill engine's last handoff
CTX = mp.get_context("spawn")  # fresh interpreters: each sets its own thread count


def make_trace(args: SimpleNamespace) -> list[dict[str, Any]]:
    """Poisson arrivals of requests with prompts of ``args.prompt`` +- 25% random tokens."""
    rng = random.Random(args.seed)
    t, trace = 0.0, []
    for i in range(args.requests):
        n = rng.randint(args.prompt * 3 // 4, args.prompt * 5 // 4)
        prompt = [rng.randrange(4, args.vocab_limit) for _ in range(n)]
        trace.append({"id": f"req-{i}", "prompt": prompt, "arrival": t})
        t += rng.expovariate(args.rate)
    return trace


def transfer(store: str, role: str) -> dict[str, Any]:
    """A SharedStorageConnector config for ``role`` over directory ``store``."""
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": store}}  # fmt: skip


def build_engine(args: SimpleNamespace, threads: int, **extra: Any) -> Any:
    """An engine for this run, warmed up on one request (not measured)."""
    import torch

    from paged_llm.engine.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    engine = LLMEngine.from_engine_args(
        model=args.checkpoint, max_model_len=args.max_model_len, seed=args.seed,
        num_gpu_blocks_override=args.gpu_blocks, skip_tokenizer_init=True, **extra,
    )  # fmt: skip
    engine.add_request("warm-up", {"prompt_token_ids": [5] * 40}, greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def greedy(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens."""
    from paged_llm.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def wait_for_start(ready: Any, start: Any) -> float:
    """Report ready, then wait for the parent's common start time (wall clock: comparable
    across processes)."""
    ready.put(1)
    while start.value == 0:
        time.sleep(0.005)
    time.sleep(max(0.0, start.value - time.time()))
    return start.value


def arrivals(trace: list[dict[str, Any]], t0: float) -> Callable[[bool], list | None]:
    """``incoming(idle)`` for an engine that receives the trace itself: the (id, prompt) pairs
    due now (sleeping until the next arrival when idle), None once all have arrived."""
    pending = list(trace)

    def incoming(idle: bool) -> list | None:
        if not pending:
            return None
        if idle:
            time.sleep(max(0.0, t0 + pending[0]["arrival"] - time.time()))
        due = []
        while pending and t0 + pending[0]["arrival"] <= time.time():
            r = pending.pop(0)
            due.append((r["id"], r["prompt"]))
        return due

    return incoming


def serve_loop(
    engine: Any,
    incoming: Callable[[bool], list | None],
    max_tokens: int,
    on_finished: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Step ``engine`` while requests come from ``incoming``; each request's token times (wall
    clock) and tokens. ``on_finished(request_id)`` runs the moment a request ends."""
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    open_ = True
    while open_ or engine.has_unfinished_requests():
        if open_:
            new = incoming(not engine.has_unfinished_requests())
            open_ = new is not None
            for rid, prompt in new or ():
                engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(max_tokens))
        if not engine.has_unfinished_requests():
            continue
        outs = engine.step()
        now = time.time()
        for o in outs:
            got = o.outputs[0].token_ids
            seen = times.setdefault(o.request_id, [])
            seen.extend([now] * (len(got) - len(seen)))
            if o.finished:
                tokens[o.request_id] = list(got)
                if on_finished is not None:
                    on_finished(o.request_id)
    return times, tokens


def colocated_worker(args, threads, extra, trace, ready, start, results) -> None:
    """One engine: the trace's arrivals in, tokens out."""
    engine = build_engine(args, threads, **extra)
    t0 = wait_for_start(ready, start)
    times, tokens = serve_loop(engine, arrivals(trace, t0), args.output)
    results.put({"times": times, "tokens": tokens})


def prefill_worker(args, threads, store, trace, handoff, ready, start, results) -> None:
    """The producer: compute each prompt and one token (saving the prompt's KV), then hand
    the request to the decode engine."""
    engine = build_engine(args, threads, kv_transfer_config=transfer(store, "kv_producer"))
    t0 = wait_for_start(ready, start)
    prompts = {r["id"]: r["prompt"] for r in trace}
    serve_loop(engine, arrivals(trace, t0), 1, lambda rid: handoff.put((rid, prompts[rid])))
    handoff.put(DONE)
    results.put({"kv": engine.kv_connector.stats()})


def decode_worker(args, threads, store, handoff, ready, start, results) -> None:
    """The consumer: load each handed-over prompt's KV instead of computing it, and decode."""
    engine = build_engine(args, threads, kv_transfer_config=transfer(store, "kv_consumer"))
    wait_for_start(ready, start)

    closed = False  # the prefill engine sent DONE

    def incoming(idle: bool) -> list | None:
        nonlocal closed
        due: list = []
        try:
            while not closed:  # everything handed over so far; wait a little when idle
                item = handoff.get(timeout=0.05) if idle and not due else handoff.get_nowait()
                closed = item == DONE
                if not closed:
                    due.append(item)
        except queue.Empty:
            pass
        return None if closed and not due else due

    times, tokens = serve_loop(engine, incoming, args.output)
    results.put({"times": times, "tokens": tokens, "kv": engine.kv_connector.stats()})


def run_processes(targets: list[tuple[Callable, tuple]]) -> tuple[list[dict[str, Any]], float]:
    """One process per (function, arguments); once all are warm they start together. What
    each put on its results queue, and the common start time."""
    ready, start = CTX.Queue(), CTX.Value("d", 0.0)
    outs = [CTX.Queue() for _ in targets]
    procs = [CTX.Process(target=f, args=(*a, ready, start, q), daemon=True)
             for (f, a), q in zip(targets, outs)]  # fmt: skip
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=900)
    start.value = time.time() + 0.2
    got = [q.get(timeout=3600) for q in outs]
    for proc in procs:
        proc.join(timeout=60)
    return got, start.value


def latencies(trace: list[dict[str, Any]], times: dict[str, list[float]], t0: float) -> dict:
    """TTFT, TPOT, ITL and E2EL summaries (ms) from each request's token times."""
    records = []
    for r in trace:
        ts = times[r["id"]]
        rec = RequestRecord(r["id"], len(r["prompt"]), len(ts), t0 + r["arrival"])
        rec.first_token_time, rec.finished_time, rec.token_times = ts[0], ts[-1], ts
        records.append(rec)
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    return {**latency_summary(records), "max_itl_ms": 1000 * max(itl, default=0.0)}


def describe(m: dict[str, Any]) -> str:
    """One line of a system's latencies."""
    return (f"TTFT mean {m['mean_ttft_ms']:.0f} ms, TPOT mean {m['mean_tpot_ms']:.1f} ms, "
            f"ITL p99 {m['p99_itl_ms']:.0f} ms (max {m['max_itl_ms']:.0f}), "
            f"E2EL mean {m['mean_e2el_ms']:.0f} ms")  # fmt: skip


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run the three systems on one trace with the config's settings; write
    disagg_prefill.json into out_dir; return it."""
    args = settings(cfg)
    trace = make_trace(args)
    half = max(1, args.threads // 2)
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": args.chunk}
    shm = Path("/dev/shm")
    store = tempfile.mkdtemp(prefix="paged-llm-kv-", dir=shm if shm.is_dir() else None)
    handoff = CTX.Queue()
    systems = {
        "colocated": [(colocated_worker, (args, args.threads, {}, trace))],
        "colocated, chunked prefill": [(colocated_worker, (args, args.threads, chunked, trace))],
        "disaggregated": [(prefill_worker, (args, half, store, trace, handoff)),
                          (decode_worker, (args, half, store, handoff))],
    }  # fmt: skip
    results: dict[str, Any] = {}
    tokens: dict[str, dict[str, list[int]]] = {}
    try:
        for name, targets in systems.items():
            got, t0 = run_processes(targets)
            served = got[-1]  # the engine the client reads tokens from
            results[name] = latencies(trace, served["times"], t0)
            tokens[name] = served["tokens"]
            if name == "disaggregated":
                results[name]["kv_transfer"] = {"producer": got[0]["kv"], "consumer": got[1]["kv"]}
            print(f"{name:>27}: {describe(results[name])}", flush=True)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    for name in results:
        results[name]["same_tokens_as_colocated"] = tokens[name] == tokens["colocated"]
    doc = {
        **run_info("real"),
        "model": args.checkpoint,
        "settings": vars(args),
        "systems": results,
        "notes": "one run per system on one Poisson trace; colocated engines get every thread, "
        "the disaggregated prefill and decode engines half each, in separate processes; TTFT "
        "is arrival to the first token the client sees (the decode engine's); KV moves as "
        "SharedStorageConnector files on a RAM disk, synchronously",
    }
    print(f"wrote {write_json(out_dir, 'disagg_prefill.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.disagg_prefill [key=value ...]`` (configs/disagg_prefill.yaml)."""
    hydra_app("disagg_prefill", write)


if __name__ == "__main__":
    main()
