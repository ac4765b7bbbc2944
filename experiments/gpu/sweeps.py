"""Two sections of the GPU check that sweep rather than check (see experiments/gpu/):

* ``kernel_sweep``: the launch configs of the paged decode kernel, the varlen paged prefill
  kernel and the int8 / int4 decode matmuls, timed on LLaMA-7B shapes; the best row per shape
  is what ``paged_llm/ops/tuning.py`` should hold for this GPU's architecture. bf16
  ``F.linear`` on the same shapes is timed beside the matmuls as their peer.
* ``quant_decode``: decode output tokens/s of a LLaMA-7B-shaped engine (random weights) in
  bf16, int8, int4 (RTN, group 128) and fp8 at batch 1 and 32 (issue: gpt-fast reached 1.48x and
  1.88x of bf16 at batch 1 on an A100), with the weight-read bound BW / weight bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
import random
import statistics
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from experiments.common.timing import Deadline
from experiments.gpu.decode_bandwidth import decode_setup, kv_bytes_read
from experiments.gpu.plans import Plan
from experiments.gpu.timing import time_op

DECODE_FIELDS = ("block_n", "num_warps", "num_stages")  # of the paged decode kernel
DECODE_CONFIGS = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 3)]
DECODE_SHAPES = [(32, 2048), (128, 2048), (32, 8192), (128, 8192)]  # (batch, context)
# Of the varlen paged prefill kernel (block_m: rows = query tokens x the query heads of one KV
# head). Candidates are block_m {32, 64, 128} x block_n {32, 64} x warps {4, 8} x stages
# {2, 3}, the FlashAttention-2-like ones first; each compiles anew (seconds on the device), so
# only the first PREFILL_MAX_CONFIGS are timed, on both workloads, within the sweep's share.
PREFILL_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
_PREFILL_FIRST = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3),
                  (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 3)]  # fmt: skip
PREFILL_CONFIGS = _PREFILL_FIRST + [
    c for c in itertools.product((32, 64, 128), (32, 64), (4, 8), (2, 3)) if c not in _PREFILL_FIRST
]
PREFILL_MAX_CONFIGS = 12
# name -> (query lengths, context lengths): 4 prompts of 512 tokens; one 512-token chunk after
# a 1536-token prefix beside 64 one-token decodes with contexts of about 1000 (decodes first,
# as the engine orders a step).
PREFILL_WORKLOADS = {
    "prefill_4x512": ([512] * 4, [512] * 4),
    "chunk512_prefix1536_64_decodes": (
        [1] * 64 + [512],
        [968 + (37 * i) % 64 for i in range(64)] + [2048],
    ),
}
# The smoke run (CPU interpreter): the same mix in miniature, two configs.
PREFILL_WORKLOADS_CPU = {
    "prefill_2x24": ([24] * 2, [24] * 2),
    "chunk16_prefix16_3_decodes": ([1] * 3 + [16], [20, 21, 23, 32]),
}
PREFILL_CONFIGS_CPU = [(16, 16, 4, 2), (32, 16, 4, 2)]
# Of the quantized matmuls; split_k 0 = from the GPU size. Runs 1-2 on an H200 timed eager
# launches, which Python's launch overhead dominated; kernels are now timed inside CUDA graphs
# (time_op(graph=True)), as the engine runs them. Two paths: tl.dot (DOT_CONFIGS, every row
# count) and multiply-and-sum (GEMV_CONFIGS, the few-row counts of GEMV_ROWS).
MATMUL_FIELDS = ("block_n", "block_k", "num_warps", "num_stages", "split_k")
DOT_CONFIGS = [
    (16, 128, 4, 3, 0),
    (32, 128, 4, 4, 0),
    (64, 64, 4, 4, 0),
    (64, 128, 4, 3, 0),
    (128, 128, 8, 3, 0),
]
GEMV_CONFIGS = [
    (16, 256, 4, 3, 0),
    (32, 128, 4, 3, 0),
    (32, 256, 4, 3, 0),
    (64, 128, 4, 3, 0),
    (16, 512, 8, 3, 0),
    (32, 256, 8, 4, 0),
    (64, 256, 8, 3, 0),
    # wider column tiles: the int4 GEMV kernel reuses each x value across a thread's columns
    (128, 128, 4, 3, 0),
    (128, 128, 8, 3, 0),
]
MATMUL_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K) of LLaMA-7B's linears
MATMUL_ROWS = [1, 4, 32]
GEMV_ROWS = (1, 4)  # the row counts the GEMV path is timed at (and may be switched on for)
MATMUL_PATHS = {"dot": (DOT_CONFIGS, 0), "gemv": (GEMV_CONFIGS, max(GEMV_ROWS))}  # gemv_rows


def _best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    timed = [r for r in rows if r.get(key) is not None]
    return min(timed, key=lambda r: r[key]) if timed else None


def _time_decode_config(inputs: tuple, context: int, config: tuple, plan: Plan, device) -> float:
    """Seconds per decode attention call with one (block_n, num_warps, num_stages)."""
    from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton

    q, k, v, tables, lens = inputs
    out = torch.empty_like(q)
    block_n, warps, stages = config
    scale = plan.attn_heads[2] ** -0.5
    return time_op(
        lambda: paged_decode_attention_triton(
            q,
            k,
            v,
            tables,
            lens,
            scale,
            max_seq_len=context,
            out=out,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        ),  # fmt: skip
        device,
        plan.timing_reps,
        graph=True,
    )


def _sweep_decode(plan: Plan, device: torch.device, dtype, deadline: Deadline, copy_bw) -> dict:
    shapes = DECODE_SHAPES if device.type == "cuda" else [(2, 64)]
    results = []
    for batch, context in shapes:
        if deadline.left() <= 0:
            break
        inputs = decode_setup(batch, context, 16, plan.attn_heads, dtype, device)
        nbytes = kv_bytes_read(batch, context, plan.attn_heads, dtype)
        rows = []
        for config in DECODE_CONFIGS:
            if deadline.left() <= 0:
                break
            row: dict[str, Any] = dict(zip(DECODE_FIELDS, config))
            try:
                t = _time_decode_config(inputs, context, config, plan, device)
                row.update(seconds=t, achieved_GBps=nbytes / t / 1e9)
                if copy_bw:
                    row["fraction_of_copy_bw"] = row["achieved_GBps"] / copy_bw
            except Exception as err:  # e.g. out of shared memory: recorded, next config
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows.append(row)
        results.append({"batch": batch, "context": context, "block_size": 16, "configs": rows,
                        "best": _best(rows, "seconds")})  # fmt: skip
        inputs = None  # free this shape's caches before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"shapes": results, "best_overall": _best_overall(results, DECODE_FIELDS)}


def _prefill_setup(query_lens, seq_lens, block_size, heads, dtype, device):
    """(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens) over shuffled blocks."""
    hq, hkv, d = heads
    per_seq = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(per_seq)).split(per_seq)
    width = max(per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for row, ids in zip(tables, order):
        row[: len(ids)] = ids
    k = torch.empty(sum(per_seq), block_size, hkv, d, device=device, dtype=dtype).normal_()
    v = torch.empty_like(k).normal_()
    q = torch.randn(sum(query_lens), hq, d, device=device, dtype=dtype)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k, v, tables.to(device), starts.to(device), lens.to(device)


def causal_attention_flops(query_lens: list[int], seq_lens: list[int], heads) -> int:
    """4 * D * Hq * (sum over queries of the positions each attends): QK^T and PV, causal
    (a query at position p sees p + 1 keys), nothing counted for masked-out work."""
    hq, _, d = heads
    keys = sum(q * s - q * (q - 1) // 2 for q, s in zip(query_lens, seq_lens))
    return 4 * d * hq * keys


def _sweep_prefill(plan: Plan, device: torch.device, dtype, deadline: Deadline) -> dict:
    """Prefill launch configs on two workloads; every config is timed on both (configs outer)
    so the best-overall choice compares like with like. A config that fails to compile or
    launch is recorded with its error; one whose output leaves the reference's tolerance
    (checked once per workload) is recorded and never chosen."""
    from paged_llm.ops.paged_attention.reference import paged_attention_reference
    from paged_llm.ops.paged_attention.triton_prefill import paged_prefill_attention_triton

    cuda = device.type == "cuda"
    workloads = PREFILL_WORKLOADS if cuda else PREFILL_WORKLOADS_CPU
    configs = PREFILL_CONFIGS[:PREFILL_MAX_CONFIGS] if cuda else PREFILL_CONFIGS_CPU
    heads, scale = plan.attn_heads, plan.attn_heads[2] ** -0.5
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)
    setups, results = {}, {}
    for name, (q_lens, s_lens) in workloads.items():
        inputs = _prefill_setup(q_lens, s_lens, 16, heads, dtype, device)
        q, k, v, tables = inputs[:4]
        ref = paged_attention_reference(q, k, v, tables, q_lens, s_lens, scale)
        setups[name] = (inputs, ref, torch.empty_like(q))
        results[name] = {
            "sequences": len(q_lens),
            "query_tokens": sum(q_lens),
            "max_context": max(s_lens),
            "flops": causal_attention_flops(q_lens, s_lens, heads),
            "configs": [],
        }
    untimed = []
    for config in configs:
        if deadline.left() <= 0:
            untimed.append(dict(zip(PREFILL_FIELDS, config)))
            continue
        overrides = dict(zip(PREFILL_FIELDS, config))
        for name, (inputs, ref, out) in setups.items():
            row: dict[str, Any] = dict(overrides)
            call = partial(paged_prefill_attention_triton, *inputs, scale, out=out, **overrides)
            try:
                call()
                err = (out.float() - ref.float()).abs()
                row["max_abs_err"] = float(err.max())
                if not bool((err <= tol["atol"] + tol["rtol"] * ref.float().abs()).all()):
                    row["error"] = f"wrong output: max abs error {row['max_abs_err']:.3g}"
                else:
                    t = time_op(call, device, plan.timing_reps, graph=True)
                    row.update(us=t * 1e6, seconds=t, TFLOPs=results[name]["flops"] / t / 1e12)
            except Exception as err:  # e.g. out of shared memory or registers: recorded
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            results[name]["configs"].append(row)
    shapes = []
    for name, entry in results.items():
        entry["best"] = _best(entry["configs"], "seconds")
        shapes.append({"workload": name, **entry})
    setups = None  # free the caches before the matmul sweep
    if cuda:
        torch.cuda.empty_cache()
    return {"block_size": 16, "workloads": shapes,
            "best_overall": _best_overall(shapes, PREFILL_FIELDS),
            "untimed": untimed, "out_of_time": bool(untimed)}  # fmt: skip


def _best_overall(shapes: list[dict[str, Any]], fields: tuple[str, ...]) -> dict[str, Any] | None:
    """The config (its ``fields``) with the lowest geometric-mean time relative to each shape's
    best."""
    ratios: dict[tuple, list[float]] = {}
    for shape in shapes:
        best = shape["best"]
        for row in shape["configs"]:
            if best and row.get("seconds"):
                key = tuple(row[f] for f in fields)
                ratios.setdefault(key, []).append(row["seconds"] / best["seconds"])
    full = {k: v for k, v in ratios.items() if len(v) == len(shapes)}
    if not full:
        return None
    key = min(full, key=lambda k: statistics.geometric_mean(full[k]))
    return {
        "config": dict(zip(fields, key)),
        "geomean_vs_best": statistics.geometric_mean(full[key]),
    }


def _int4_weight(n: int, k: int, device: torch.device) -> dict[str, torch.Tensor]:
    group = 128
    return {
        "qweight": torch.randint(
            -(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device
        ),
        "qzeros": torch.randint(
            -(2**31), 2**31 - 1, (k // group, n // 8), dtype=torch.int32, device=device
        ),
        "scales": (torch.rand(k // group, n, device=device) / 50).half(),
    }


def _matmul_calls(n: int, k: int, rows: int, dtype, device) -> dict[str, tuple]:
    """name -> (weight bytes, call(config, gemv_rows) or call() for the bf16 peer) on random
    weights."""
    import torch.nn.functional as F

    from paged_llm.ops.quant_matmul.triton import int4_matmul_triton, int8_matmul_triton

    x = torch.randn(rows, k, device=device, dtype=dtype)
    w16 = torch.randn(n, k, device=device, dtype=dtype)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    s8 = torch.rand(n, device=device) / 100
    w4 = _int4_weight(n, k, device)
    return {
        "bf16_linear": (2 * n * k, lambda: F.linear(x, w16)),
        "int8": (n * k, lambda cfg, gemv: int8_matmul_triton(x, w8, s8, *cfg, gemv_rows=gemv)),
        "int4": (n * k // 2, lambda cfg, gemv: int4_matmul_triton(
            x, w4["qweight"], w4["qzeros"], w4["scales"], 128, 1, *cfg, gemv_rows=gemv)),
    }  # fmt: skip


def _time_matmul_configs(call, path: str, weight_bytes: int, t16: float, plan: Plan, device,
                         deadline: Deadline, copy_bw) -> dict[str, Any]:  # fmt: skip
    """Every config of one path (``dot`` or ``gemv``) of one kernel on one shape."""
    configs, gemv_rows = MATMUL_PATHS[path]
    rows = []
    for config in configs:
        if deadline.left() <= 0:
            break
        row: dict[str, Any] = dict(zip(MATMUL_FIELDS, config))
        try:
            t = time_op(partial(call, config, gemv_rows), device, plan.timing_reps, graph=True)
            row.update(seconds=t, weight_GBps=weight_bytes / t / 1e9, speedup_vs_bf16=t16 / t)
            if copy_bw:
                row["fraction_of_copy_bw"] = row["weight_GBps"] / copy_bw
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
    return {"configs": rows, "best": _best(rows, "seconds")}


def _sweep_matmul(plan: Plan, device: torch.device, dtype, deadline: Deadline, copy_bw) -> dict:
    shapes = MATMUL_SHAPES if device.type == "cuda" else [(64, 128)]
    results = []
    for n, k in shapes:
        for rows_m in MATMUL_ROWS:
            if deadline.left() <= 0:
                break
            calls = _matmul_calls(n, k, rows_m, dtype, device)
            peer_bytes, peer = calls.pop("bf16_linear")
            t16 = time_op(peer, device, plan.timing_reps, graph=True)
            entry: dict[str, Any] = {"N": n, "K": k, "rows": rows_m}
            entry["bf16_linear"] = {"seconds": t16, "weight_GBps": peer_bytes / t16 / 1e9}
            paths = ("dot", "gemv") if rows_m in GEMV_ROWS else ("dot",)
            for name, (weight_bytes, call) in calls.items():
                entry[name] = {path: _time_matmul_configs(call, path, weight_bytes, t16, plan,
                                                          device, deadline, copy_bw)
                               for path in paths}  # fmt: skip
            results.append(entry)
    best = {}
    for name in ("int8", "int4"):
        for path in MATMUL_PATHS:
            timed = [r[name][path] for r in results if path in r.get(name, {})]
            best[f"{name}_{path}"] = _best_overall(timed, MATMUL_FIELDS)
        best[f"{name}_gemv_rows"] = _gemv_rows(results, name)
    # past the deadline some configs went untimed on some shapes, so a best_overall entry can
    # be None (no config timed everywhere); say so rather than leave a reader to guess
    return {"shapes": results, "best_overall": best, "out_of_time": deadline.left() <= 0}


def _gemv_rows(results: list[dict[str, Any]], name: str) -> int:
    """The largest timed row count at which the GEMV path beat tl.dot on every shape (0: none)."""
    for rows in sorted(GEMV_ROWS, reverse=True):
        entries = [r[name] for r in results if r["rows"] == rows and name in r]
        wins = [
            e["gemv"]["best"] and e["dot"]["best"]
            and e["gemv"]["best"]["seconds"] < e["dot"]["best"]["seconds"]
            for e in entries
        ]  # fmt: skip
        if entries and all(wins):
            return rows
    return 0


def section_kernel_sweep(
    plan: Plan, device: torch.device, deadline: Deadline, copy_bw: float | None
) -> dict[str, Any]:
    """Launch-config sweeps of the decode and prefill attention and quantized matmul kernels."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    share = Deadline.after(max(1.0, deadline.left() * 0.2))  # tuned in runs 1-2 already
    decode = _sweep_decode(plan, device, dtype, share, copy_bw)
    # half of what is left: its rows are untuned, and every config compiles anew
    prefill = _sweep_prefill(plan, device, dtype, Deadline.after(max(1.0, deadline.left() / 2)))
    matmul = _sweep_matmul(plan, device, dtype, deadline, copy_bw)
    return {
        "dtype": dtype,
        "heads": plan.attn_heads,
        "decode": decode,
        "prefill": prefill,
        "matmul": matmul,
        "applied": apply_best_configs(decode, matmul, device, prefill),
    }


def apply_best_configs(
    decode: dict, matmul: dict, device: torch.device, prefill: dict | None = None
) -> dict[str, Any]:
    """Make the sweep's best configs this process's tuned rows for the device's architecture,
    so the later sections run with them; return what was applied (copy it into
    paged_llm/ops/tuning.py to keep it)."""
    from paged_llm.ops import tuning

    if device.type != "cuda":  # CPU timings say nothing about a GPU's configs
        return {}
    arch = tuning.arch_of(device)
    found = matmul.get("best_overall", {})
    best = {"paged_decode": decode.get("best_overall"),
            "paged_prefill": (prefill or {}).get("best_overall")}  # fmt: skip
    for name in ("int8", "int4"):
        best[f"{name}_gemv"] = found.get(f"{name}_gemv")
        dot = found.get(f"{name}_dot")
        if dot:
            gemv_rows = found.get(f"{name}_gemv_rows", 0)
            best[f"{name}_matmul"] = {"config": {**dot["config"], "gemv_rows": gemv_rows}}
    applied = {}
    for kernel, row in best.items():
        if not row:
            continue
        config = tuning.KernelConfig(**row["config"])
        tuning.TUNED[kernel][arch] = config
        applied[kernel] = {"arch": arch, **dataclasses.asdict(config)}
    return applied


# ---- quantized decode throughput --------------------------------------------------------------
def _decode_rate(engine: Any, batch: int, prompt_len: int, new_tokens: int, vocab: int,
                 deadline: Deadline) -> dict[str, Any]:  # fmt: skip
    """Output tokens/s of ``batch`` greedy sequences decoding together, after their prefill."""
    from paged_llm import SamplingParams

    rng = random.Random(batch)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(vocab) for _ in
                                                      range(prompt_len)]}, params)  # fmt: skip
    started: set[str] = set()
    while len(started) < batch and engine.has_unfinished_requests():  # prefill (maybe chunked)
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests() and deadline.left() > 0:
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    engine.abort_request(ids)
    return {
        "batch": batch,
        "decode_steps": steps,
        "elapsed_s": elapsed,
        "output_tokens_per_s": batch * steps / elapsed if steps else None,
        "ms_per_step": 1e3 * elapsed / steps if steps else None,
    }


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block, then restore them."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _measure_method(model: str, method: str | None, plan: Plan, device: torch.device,
                    share: Deadline, copy_bw: float | None, smoke: bool, prompt_len: int,
                    new_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Build one engine (quantized by ``method``), time decode at batch 1 and 32, free it."""
    from paged_llm import LLM

    row: dict[str, Any] = {}
    start = time.perf_counter()
    llm = LLM(model, quantization=method, dtype=plan.dtype, max_num_seqs=32,
              max_model_len=prompt_len + new_tokens + 16, max_num_batched_tokens=4096,
              gpu_memory_utilization=0.6, device=str(device), seed=0,
              **({"cpu_kv_cache_gib": 0.02} if smoke else {}))  # fmt: skip
    engine = llm.llm_engine
    model_module = engine.runner.model
    row["engine_build_s"] = time.perf_counter() - start
    row["weight_bytes"] = sum(
        t.numel() * t.element_size() for t in [*model_module.parameters(), *model_module.buffers()]
    )
    row["cuda_graphs"] = engine.runner.cuda_graphs is not None
    vocab = engine.vocab_size
    _decode_rate(engine, 1, prompt_len, 4, vocab, share)  # warm-up: kernels compile
    for batch in (1, 32):
        row[f"batch_{batch}"] = _decode_rate(engine, batch, prompt_len, new_tokens, vocab, share)
    if copy_bw:
        # Reading every weight once per step (at copy speed) bounds batch-1 decode.
        row["batch_1_weight_read_bound_tokens_per_s"] = copy_bw * 1e9 / row["weight_bytes"]
    llm.shutdown()
    return row


def section_quant_decode(
    plan: Plan, device: torch.device, deadline: Deadline, copy_bw: float | None
) -> dict[str, Any]:
    """Decode tokens/s at batch 1 and 32 in bf16, int8, int4 and fp8 on the plan's model shape
    (and bf16 without the fused elementwise kernels)."""
    smoke = device.type == "cpu"
    model = plan.model if not smoke else "tiny"
    # label -> (quantization, environment); the unfused row is bf16 with the fused elementwise
    # kernels off (ops/elementwise), the A/B of those kernels.
    methods = {
        "none": (None, {}),
        "int8": ("int8", {}),
        "int4_rtn": ("int4_rtn", {}),
        "fp8": ("fp8", {}),
        "none_unfused_elementwise": (None, {"PAGED_LLM_FUSED_ELEMENTWISE": "0"}),
    }
    new_tokens, prompt_len = (64, 128) if not smoke else (4, 8)
    results: dict[str, Any] = {}
    for label, (method, env) in methods.items():
        share = Deadline.after(max(1.0, deadline.left() / (len(methods) - len(results))))
        if share.left() < 5 and not smoke:
            results[label] = {"skipped": f"{share.left():.0f} s left"}
            continue
        row: dict[str, Any] = {"environment": env} if env else {}
        try:
            with _environment(env):
                row.update(_measure_method(model, method, plan, device, share, copy_bw, smoke,
                                           prompt_len, new_tokens))  # fmt: skip
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results[label] = row
    base = results.get("none", {})
    for row in results.values():
        for batch in (1, 32):
            ours = row.get(f"batch_{batch}", {}).get("output_tokens_per_s")
            ref = base.get(f"batch_{batch}", {}).get("output_tokens_per_s")
            if ours and ref:
                row[f"batch_{batch}_vs_none"] = ours / ref
    return {
        "model": model,
        "dtype": plan.dtype,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "methods": results,
        "reference": "gpt-fast on A100, batch 1: int8 1.48x and int4 1.88x of bf16",
    }
