"""The one prepared GPU check (issue 9): everything a short GPU loan should measure, in one run
that writes one JSON file. Each section is time-boxed; a section that cannot fit in what is
left of the budget is skipped with the reason recorded, and the JSON is rewritten after every
section, so a run cut short still leaves its results.

    python -m experiments.gpu_check --out outputs/gpu_check            # full: < 8 min, one H200
    python -m experiments.gpu_check --quick --out outputs/gpu_check    # ~4 min
    ... --extras    # + kernel_sweep and quant_decode (experiments/gpu_sweeps.py), ~2.5 min more
    python -m experiments.gpu_check --smoke --out /tmp/gpu_check       # CPU, tiny, interpreter
    ... --trace paged_llm/workloads/data/sharegpt_opt_lengths.csv            # ShareGPT lengths

Sections, in order (later ones use the bandwidth measured first):

1. ``bandwidth``: device-to-device copy bandwidth ((read + write) bytes / s) and bf16 matmul rate.
2. ``kernels``: every Triton kernel (KV store incl. int8/fp8, paged decode with and without
   split-K and with an int8 cache, paged prefill, block copy, int8/int4 matmul, multi-LoRA
   shrink/expand) against its
   torch reference on the device, in fp16, bf16 and fp32.
   ``parity`` (experiments/gpu_parity.py): greedy tokens of this engine vs transformers on the
   same device for Llama/Mistral/Qwen2/OPT in fp32 (must be identical), bf16 and fp16.
   ``kernel_sweep`` (--extras; experiments/gpu_sweeps.py): launch configs of the decode and
   varlen prefill attention and quantized matmul kernels on LLaMA-7B shapes, the data behind
   paged_llm/ops/tuning.py.
3. ``decode_bandwidth``: the paged decode kernel's achieved bandwidth (K/V bytes read / time)
   at batch 1/32/128, contexts 512-8192, block sizes 16/32, as a fraction of the copy bandwidth.
4. ``fig18a``: the paper's Fig. 18a, paged vs contiguous attention kernel latency: the Triton
   paged kernel (shuffled blocks), the same kernel over in-order blocks, and torch SDPA over a
   contiguous [B, H, L, D] cache.
5. ``end_to_end``: offline throughput of this engine on a LLaMA-7B-shaped model with random
   bf16 weights on ShareGPT-shaped requests, against transformers' static-batch ``generate``
   and continuous-batching ``generate_batch`` on the same GPU, and against the bandwidth bound
   B x BW / (weight bytes + B x context x KV bytes per token).
6. ``quant_decode`` (--extras; experiments/gpu_sweeps.py): decode tokens/s of the same model
   shape in bf16, int8, int4 and fp8 at batch 1 and 32.
7. ``sleep_offload`` (--extras; experiments/gpu_memory_features.py): sleep mode at levels 1 and 2
   with CUDA graphs (memory freed, seconds, same outputs after waking), the prefix cache's
   CPU tier (an evicted prompt copied back from pinned memory, same output) and KV transfer
   between a producer and a consumer engine (blocks moved, ms per block, same tokens).
8. ``spec_decode`` (--extras; experiments/gpu_spec_decode.py): the built-in trained target with
   its draft model, EAGLE head and n-grams: greedy outputs against the target alone (float32)
   and tokens/s at k = 2 and 4, batch 1 and 16. Its models are exported before the loan:
   ``python -m experiments.gpu_spec_decode --export .gpu_inputs/spec_models``.

Targets (docs/gpu.md) are evaluated into ``targets`` in the JSON; nothing here is estimated.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv[1:]:  # before triton is imported: kernels run in its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

SCHEMA = "paged_llm.gpu_check/1"
# with --extras: experiments/gpu_sweeps.py and experiments/gpu_memory_features.py
EXTRA_SECTIONS = ("kernel_sweep", "quant_decode", "sleep_offload", "spec_decode")
SECTIONS = (
    "kernels", "parity", "kernel_sweep", "decode_bandwidth", "fig18a", "end_to_end",
    "quant_decode", "sleep_offload", "spec_decode",
)  # fmt: skip


def selected_sections(args: argparse.Namespace) -> set[str]:
    """The sections this run does: --only's list, else the core ones (+ the extras)."""
    if args.only:
        chosen = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = chosen - set(SECTIONS) - {"bandwidth"}
        if unknown:
            raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
        return chosen
    return {n for n in SECTIONS if n not in EXTRA_SECTIONS or args.extras}


TOL = {  # the tolerances of tests/test_kernels.py
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# ---- plans --------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Sizes and time budgets of one mode."""

    mode: str
    budget_s: float  # for all sections together (imports and start-up come on top)
    section_s: dict[str, float]  # each section's own cap
    copy_mib: int
    matmul_n: int
    kernel_dtypes: list[str]
    kernel_heads: tuple[int, int, int]  # (Hq, Hkv, D) of the correctness checks
    kernel_seq_lens: list[int]
    attn_heads: tuple[int, int, int]  # (Hq, Hkv, D) of the timing sections (LLaMA-7B: 32/32/128)
    decode_batches: list[int]
    decode_contexts: list[int]
    block_sizes: list[int]
    fig18_batches: list[int]
    fig18_contexts: list[int]
    timing_reps: int
    model: str  # a preset name, or "tiny-llama" (saved to a temp dir)
    dtype: str
    num_requests: int
    max_total: int  # prompt + output tokens per request (the paper's ShareGPT filter: 2048)
    max_num_seqs: int
    hf_batch_size: int  # static generate
    hf_subset: int  # requests for generate_batch (and ours on the same requests)
    warmup_requests: int = 8


FULL = Plan(
    mode="full",
    # Sections stop at their deadlines, but model builds and shutdowns can run ~1 min past
    # them; with ~20 s of imports this stays under 8 minutes. --extras adds the two sweep
    # sections and their caps (about 3 minutes more).
    budget_s=400,
    section_s=dict(
        bandwidth=10,
        kernels=60,
        parity=40,
        kernel_sweep=75,
        decode_bandwidth=40,
        fig18a=20,
        end_to_end=220,
        quant_decode=90,
        sleep_offload=90,
        spec_decode=150,
    ),
    copy_mib=2048,
    matmul_n=8192,
    kernel_dtypes=["fp16", "bf16", "fp32"],
    kernel_heads=(32, 8, 128),
    kernel_seq_lens=[1, 17, 300, 1100],
    attn_heads=(32, 32, 128),
    decode_batches=[1, 32, 128],
    decode_contexts=[512, 1024, 2048, 4096, 8192],
    block_sizes=[16, 32],
    fig18_batches=[8, 32],
    fig18_contexts=[64, 128, 256, 512, 1024, 2048],
    timing_reps=5,
    model="llama-7b",
    dtype="bfloat16",
    num_requests=1000,
    max_total=2048,
    max_num_seqs=256,
    hf_batch_size=32,
    hf_subset=200,
)
PLANS = {
    "full": FULL,
    "quick": replace(
        FULL,
        mode="quick",
        budget_s=200,
        section_s=dict(
            bandwidth=10,
            kernels=35,
            parity=30,
            kernel_sweep=30,
            decode_bandwidth=25,
            fig18a=15,
            end_to_end=100,
            quant_decode=60,
            sleep_offload=75,
            spec_decode=60,
        ),
        copy_mib=1024,
        kernel_seq_lens=[1, 17, 300],
        decode_contexts=[512, 2048, 8192],
        fig18_contexts=[128, 512, 2048],
        timing_reps=3,
        num_requests=200,
        hf_subset=64,
    ),
    # CPU, Triton interpreter, a tiny Llama saved with transformers: only checks the plumbing.
    "smoke": replace(
        FULL,
        mode="smoke",
        budget_s=70,
        section_s=dict(
            bandwidth=3,
            kernels=15,
            parity=20,
            kernel_sweep=8,
            decode_bandwidth=6,
            fig18a=4,
            end_to_end=20,
            quant_decode=15,
            sleep_offload=20,
            spec_decode=30,
        ),
        copy_mib=8,
        matmul_n=128,
        kernel_dtypes=["fp32"],
        kernel_heads=(4, 2, 16),
        kernel_seq_lens=[1, 9, 21],
        attn_heads=(4, 2, 16),
        decode_batches=[1, 2],
        decode_contexts=[32, 64],
        fig18_batches=[2],
        fig18_contexts=[32],
        timing_reps=2,
        model="tiny-llama",
        dtype="float32",
        num_requests=6,
        max_total=40,
        max_num_seqs=8,
        hf_batch_size=3,
        hf_subset=4,
        warmup_requests=2,
    ),
}


# ---- budget, timing, records -------------------------------------------------------------------
class Budget:
    """Wall-clock budget of the whole run."""

    def __init__(self, total_s: float) -> None:
        self.start = time.perf_counter()
        self.total_s = total_s

    def left(self) -> float:
        """Seconds left."""
        return self.total_s - (time.perf_counter() - self.start)


@dataclass
class Deadline:
    """The end of one section (or part of one): ``time.perf_counter()`` value."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now."""
        return cls(time.perf_counter() + seconds)

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.at - time.perf_counter()


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(
    fn: Callable[[], Any], device: torch.device, reps: int, inner: int = 0, graph: bool = False
) -> float:
    """Median seconds per call of ``fn`` (after a warm-up), over ``reps`` timed groups.

    ``graph=True`` (CUDA) captures the group's calls in one CUDA graph and times its replays,
    so a kernel's time excludes Python's launch overhead (tens of microseconds for a Triton
    launch, more than many decode kernels take); eager timing is the fallback if capture fails.
    """
    fn()
    sync(device)
    if inner <= 0:  # enough calls per group to time ~20 ms of work
        start = time.perf_counter()
        fn()
        sync(device)
        inner = max(1, min(100, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    run = lambda: [fn() for _ in range(inner)]  # noqa: E731
    if device.type == "cuda" and graph:
        try:
            run = _captured(fn, inner).replay
        except Exception as err:  # recorded in the log; eager timing still measures something
            print(f"[gpu_check] CUDA graph capture failed, timing eagerly: {err}", flush=True)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3 / inner)
        else:
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _captured(fn: Callable[[], Any], calls: int) -> Any:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


@dataclass
class Report:
    """The JSON document, rewritten after every section."""

    path: Path
    doc: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        """Write atomically (a run killed mid-write keeps the previous version)."""
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def run_section(
    report: Report,
    name: str,
    budget: Budget,
    cap_s: float,
    min_s: float,
    fn: Callable[[Deadline], dict[str, Any]],
) -> dict[str, Any]:
    """Run one section within min(cap_s, budget left); record its result, skip or error."""
    left = budget.left()
    start = time.perf_counter()
    if left < min_s:
        result = {"status": "skipped", "reason": f"budget: {left:.0f} s left, needs >= {min_s} s"}
    else:
        try:
            result = {"status": "ok", **fn(Deadline.after(min(cap_s, left)))}
        except Exception as err:  # recorded, and the next section still runs
            result = {
                "status": "error",
                "reason": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=8),
            }
    result["seconds"] = round(time.perf_counter() - start, 2)
    # a thread a section leaves running (transformers' continuous-batching loop past its join
    # timeout, say) takes the GIL from later sections' launch-bound loops: say so
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        result["threads_left_running"] = others
    report.doc["sections"][name] = result
    report.write()
    print(f"[gpu_check] {name}: {result['status']} in {result['seconds']} s", flush=True)
    return result


# ---- 1. bandwidth and matmul rate --------------------------------------------------------------
def section_bandwidth(plan: Plan, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Device-to-device copy bandwidth and bf16 matmul throughput."""
    nbytes = plan.copy_mib * 2**20
    t_copy = _time_copy(nbytes, device, plan.timing_reps)
    n = plan.matmul_n
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    t_mm = time_op(lambda: a @ b, device, plan.timing_reps)
    return {
        "copy_bytes": nbytes,
        "copy_seconds": t_copy,
        # A copy reads and writes every byte: bandwidth counts both, as STREAM's copy does.
        "copy_bandwidth_GBps": 2 * nbytes / t_copy / 1e9,
        "matmul_n": n,
        "matmul_bf16_TFLOPs": 2 * n**3 / t_mm / 1e12,
    }


def _time_copy(nbytes: int, device: torch.device, reps: int) -> float:
    """Seconds per device-to-device copy of ``nbytes`` (the buffers are freed on return)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return time_op(lambda: dst.copy_(src), device, reps)


# ---- 2. kernel correctness ---------------------------------------------------------------------
def paged_cache(seq_lens, block_size, hkv, head_dim, dtype, device, seed=0):
    """Random K/V caches with shuffled block tables for ``seq_lens`` (as tests/test_kernels.py)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    shape = (num_blocks, block_size, hkv, head_dim)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    width = max(needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k, v, padded.to(device)


def _compare(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, **tol) -> dict:
    """Max error of ``out`` vs ``ref`` and whether it is within tolerance."""
    tol = tol or TOL[dtype]
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    limit = tol["atol"] + tol["rtol"] * ref.abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= limit).all())
    return {
        "check": name,
        "dtype": str(dtype).removeprefix("torch."),
        "max_abs_err": float(err.max()) if err.numel() else 0.0,
        **tol,
        "pass": ok,
    }


def kernel_checks(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every Triton kernel against its reference in one dtype; a kernel that raises is recorded
    as a failed check and the others still run."""
    results = []
    checks = (check_store_kv, check_store_kv_quantized, check_decode, check_prefill,
              check_copy_blocks, check_quant_matmul, check_fp8_linear,
              check_elementwise, check_lora, check_moe)  # fmt: skip
    for check in checks:
        torch.manual_seed(0)
        try:
            results.extend(check(plan, device, dtype))
        except Exception as err:
            results.append({"check": check.__name__.removeprefix("check_"), "dtype": dtype,
                            "pass": False, "error": f"{type(err).__name__}: {err}"})  # fmt: skip
    return results


def check_store_kv(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """KV store: bit-exact, padding slots (-1) skipped."""
    from paged_llm.ops.kv_store.reference import store_kv_reference
    from paged_llm.ops.kv_store.triton import store_kv_triton

    _, hkv, d = plan.kernel_heads
    k_ref, v_ref, _ = paged_cache([64], 16, hkv, d, dtype, device)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    slots = torch.randperm(k_ref.shape[0] * 16, device=device)[:12]
    slots[3] = -1
    key, val = (torch.randn(12, hkv, d, device=device, dtype=dtype) for _ in range(2))
    store_kv_reference(key, val, k_ref, v_ref, slots)
    store_kv_triton(key, val, k_tri, v_tri, slots)
    out, ref = torch.stack([k_tri, v_tri]), torch.stack([k_ref, v_ref])
    return [_compare("store_kv", out, ref, dtype, atol=0.0, rtol=0.0)]


def check_store_kv_quantized(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Quantizing KV store (int8, and fp8 e4m3 where the GPU has it): dequantized values."""
    from paged_llm.ops.kv_store.reference import store_kv_reference
    from paged_llm.ops.kv_store.triton import store_kv_triton
    from paged_llm.quant.kv_cache import KV_CACHE_DTYPES

    _, hkv, d = plan.kernel_heads
    key, val = (torch.randn(12, hkv, d, device=device, dtype=dtype) for _ in range(2))
    slots = torch.arange(12, device=device)
    fp8 = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    results = []
    for name in ["int8"] + (["fp8_e4m3"] if fp8 else []):
        spec = KV_CACHE_DTYPES[name]
        caches = [torch.zeros(4, 16, hkv, d, device=device).to(spec.dtype) for _ in range(4)]
        scales = [torch.zeros(4, 16, hkv, device=device) for _ in range(4)]
        store_kv_reference(key, val, caches[0], caches[1], slots, scales[0], scales[1])
        store_kv_triton(key, val, caches[2], caches[3], slots, scales[2], scales[3])
        deq = [spec.dequantize(c, s, torch.float32) for c, s in zip(caches, scales)]
        # A division rounding differently can move a code one step: allow one step (int8),
        # or one step of the top fp8 binade (32 codes apart).
        step = float(scales[0].max()) * (1.0 if name == "int8" else 32.0)
        out, ref = torch.stack(deq[2:]), torch.stack(deq[:2])
        results.append(_compare(f"store_kv_{name}", out, ref, dtype, atol=step, rtol=0.0))
    return results


def check_decode(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Paged decode over shuffled blocks with GQA: split-K off, forced, automatic; and over an
    int8 cache."""
    from paged_llm.ops.paged_attention.reference import paged_attention_reference
    from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton
    from paged_llm.quant.kv_cache import KV_CACHE_DTYPES

    hq, hkv, d = plan.kernel_heads
    seq_lens, scale = plan.kernel_seq_lens, d**-0.5
    k, v, tables = paged_cache(seq_lens, 16, hkv, d, dtype, device)
    query = torch.randn(len(seq_lens), hq, d, device=device, dtype=dtype)
    ones = [1] * len(seq_lens)
    ref = paged_attention_reference(query, k, v, tables, ones, seq_lens, scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    results = []
    for splits in (1, 4, None):
        out = paged_decode_attention_triton(query, k, v, tables, lens, scale, num_splits=splits)
        results.append(_compare(f"paged_decode_splits_{splits or 'auto'}", out, ref, dtype))
    spec = KV_CACHE_DTYPES["int8"]
    (kq, ks), (vq, vs) = (spec.quantize(c.float().flatten(0, 1)) for c in (k, v))
    kq, vq, ks, vs = kq.view(k.shape), vq.view(k.shape), ks.view(k.shape[:3]), vs.view(k.shape[:3])
    ref = paged_attention_reference(query, kq, vq, tables, ones, seq_lens, scale, ks, vs)
    out = paged_decode_attention_triton(query, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs)
    results.append(_compare("paged_decode_int8_cache", out, ref, dtype))
    window = 100  # a sliding window inside the longer contexts, not a multiple of any tile
    ref = paged_attention_reference(
        query, k, v, tables, ones, seq_lens, scale, sliding_window=window
    )
    for splits in (1, None):
        out = paged_decode_attention_triton(
            query, k, v, tables, lens, scale, num_splits=splits, sliding_window=window
        )
        results.append(_compare(f"paged_decode_window_splits_{splits or 'auto'}", out, ref, dtype))
    return results


def check_prefill(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Paged prefill: each sequence's last query tokens over its cached prefix, causal."""
    from paged_llm.ops.paged_attention.reference import paged_attention_reference
    from paged_llm.ops.paged_attention.triton_prefill import paged_prefill_attention_triton

    hq, hkv, d = plan.kernel_heads
    seq_lens, scale = plan.kernel_seq_lens, d**-0.5
    k, v, tables = paged_cache(seq_lens, 16, hkv, d, dtype, device)
    q_lens = [min(s, q) for s, q in zip(seq_lens, [1, 9, 33, 70])]
    q = torch.randn(sum(q_lens), hq, d, device=device, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    ref = paged_attention_reference(q, k, v, tables, q_lens, seq_lens, scale)
    out = paged_prefill_attention_triton(q, k, v, tables, starts.to(device), lens, scale)
    results = [_compare("paged_prefill", out, ref, dtype)]
    ref = paged_attention_reference(q, k, v, tables, q_lens, seq_lens, scale, sliding_window=21)
    out = paged_prefill_attention_triton(
        q, k, v, tables, starts.to(device), lens, scale, sliding_window=21
    )
    return results + [_compare("paged_prefill_window_21", out, ref, dtype)]


def check_copy_blocks(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Block copy (copy-on-write, in-device swaps): bit-exact."""
    from paged_llm.ops.copy_blocks.reference import copy_blocks_reference
    from paged_llm.ops.copy_blocks.triton import copy_blocks_triton

    _, hkv, d = plan.kernel_heads
    k, v, _ = paged_cache([64], 16, hkv, d, dtype, device)  # 4 + 2 spare blocks
    k_ref, v_ref = k.clone(), v.clone()
    src, dst = torch.tensor([0, 2], device=device), torch.tensor([1, 3], device=device)
    copy_blocks_reference(k_ref, v_ref, src, dst)
    copy_blocks_triton(k, v, src, dst)
    out, ref = torch.stack([k, v]), torch.stack([k_ref, v_ref])
    return [_compare("copy_blocks", out, ref, dtype, atol=0.0, rtol=0.0)]


def check_lora(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Multi-LoRA shrink/expand kernels against the torch reference: decode-sized (1 and 7
    rows) and prefill-sized (64 rows) batches mixing three adapters and base-model tokens."""
    from paged_llm.ops.lora.reference import add_lora_reference
    from paged_llm.ops.lora.triton import add_lora_triton

    hq, _, d = plan.kernel_heads
    k, n, rank, slots = hq * d, 2 * hq * d + 8, 16, 3  # an odd N: masked output tiles
    results = []
    for rows in (1, 7, 64):
        x = torch.randn(rows, k, device=device).to(dtype)
        y = torch.randn(rows, n, device=device).to(dtype)
        a = (torch.randn(slots, rank, k, device=device) / k**0.5).to(dtype)
        b = (0.1 * torch.randn(slots, n, rank, device=device)).to(dtype)
        token_slots = torch.randint(-1, slots, (rows,), device=device)
        ref = add_lora_reference(y.clone(), x, a, b, token_slots)
        out = add_lora_triton(y.clone(), x, a, b, token_slots)
        results.append(_compare(f"lora_rows_{rows}", out, ref, dtype))
    return results


def check_moe(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Fused MoE grouped GEMMs against the torch reference: decode-sized (1 and 7 tokens) and
    prefill-sized (300 tokens) batches routed top-2 of 8 experts (Mixtral's routing)."""
    from paged_llm.ops.moe.reference import fused_experts_reference, select_experts
    from paged_llm.ops.moe.triton import fused_experts_triton

    hq, _, d = plan.kernel_heads
    hidden, inter, experts = hq * d, 2 * hq * d + 16, 8  # an odd I: masked tiles
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    results = []
    for tokens in (1, 7, 300):
        x = torch.randn(tokens, hidden, device=device).to(dtype)
        weights, ids = select_experts(torch.randn(tokens, experts, device=device), 2, True)
        ref = fused_experts_reference(x, gate_up, down, weights, ids)
        out = fused_experts_triton(x, gate_up, down, weights, ids)
        results.append(_compare(f"fused_moe_tokens_{tokens}", out, ref, dtype))
    # int8 / fp8 experts (quantization="int8" / "fp8"): quantized tiles, per-channel scales
    # after the K loop; fp8 tiles need an FP8-capable GPU (compute capability >= 8.9)
    from paged_llm.quant.layers import fp8_matmul_supported, fp8_per_channel, int8_per_channel

    methods = {"int8": int8_per_channel}
    if fp8_matmul_supported(device):
        methods["fp8"] = fp8_per_channel
    x = torch.randn(7, hidden, device=device).to(dtype)
    weights, ids = select_experts(torch.randn(7, experts, device=device), 2, True)
    for name, per_channel in methods.items():
        (q_gate_up, s_gate_up), (q_down, s_down) = per_channel(gate_up), per_channel(down)
        args = (x, q_gate_up, q_down, weights, ids, s_gate_up, s_down)
        out, ref = fused_experts_triton(*args), fused_experts_reference(*args)
        results.append(_compare(f"fused_moe_{name}_tokens_7", out, ref, dtype))
    # int4 experts (quantization="int4_rtn"): packed tiles dequantized per group of 64 inputs
    from paged_llm.layers.moe import FusedExperts
    from paged_llm.quant.experts import quantize_experts_int4

    int4 = FusedExperts(experts, hidden, 2 * hidden).to(device)  # I = 2H: groups divide it
    with torch.no_grad():
        int4.gate_up_proj.normal_(std=hidden**-0.5)
        int4.down_proj.normal_(std=(2 * hidden) ** -0.5)
    quantize_experts_int4(int4, 64)
    args = (x, int4.gate_up_proj, int4.down_proj, weights, ids, int4.gate_up_scale,
            int4.down_scale, int4.gate_up_zero, int4.down_zero)  # fmt: skip
    out, ref = fused_experts_triton(*args), fused_experts_reference(*args)
    results.append(_compare("fused_moe_int4_tokens_7", out, ref, dtype))
    return results


def check_quant_matmul(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The int8, fp8 and int4 (GPTQ layout) decode matmul kernels against dequantize + matmul,
    on both paths: GEMV (1 row) and tl.dot (5 / 7 rows)."""
    from paged_llm.ops.quant_matmul.reference import int4_matmul_reference, int8_matmul_reference
    from paged_llm.ops.quant_matmul.triton import (
        fp8_matmul_triton,
        int4_matmul_triton,
        int8_matmul_triton,
    )
    from paged_llm.quant.packing import pack_int4

    # relative to the largest output, as tests/test_quant_layers.py does
    rel = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (80, 72), generator=gen, dtype=torch.int8).to(device)
    scale = (torch.rand(80, generator=gen) / 100).to(device)
    w_fp8 = (torch.randn(80, 72, generator=gen) * 8).to(torch.float8_e4m3fn).to(device)
    k, n, group = 256, 48, 64
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) / 50).to(device=device, dtype=torch.float16)
    qweight, qzeros = pack_int4(q, 0).to(device), pack_int4(zeros, 1).to(device)
    g_idx = (torch.arange(k) // group).to(device)
    fp8_ok = device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)
    results = []
    for rows in (1, 5):  # GEMV (rows <= gemv_rows = 4) and tl.dot
        x = torch.randn(rows, 72, generator=gen).to(device=device, dtype=dtype)
        x4 = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
        pairs = [
            ("int8_matmul", int8_matmul_triton(x, w, scale),
             int8_matmul_reference(x.float(), w, scale)),
            ("int4_matmul", int4_matmul_triton(x4, qweight, qzeros, scales, group, 1),
             int4_matmul_reference(x4.float(), qweight, qzeros, scales, g_idx, 1)),
        ]  # fmt: skip
        if fp8_ok:
            pairs.append(("fp8_matmul", fp8_matmul_triton(x, w_fp8, scale),
                          int8_matmul_reference(x.float(), w_fp8.float(), scale)))  # fmt: skip
        for name, out, ref in pairs:
            tol = rel * float(ref.abs().max())
            results.append(_compare(f"{name}_rows_{rows}", out, ref, dtype, atol=tol, rtol=rel))
    return results


def check_elementwise(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Fused RMSNorm, rotary and SwiGLU-gate kernels against the torch reference (which rounds
    as transformers does); on a GPU both round to nearest, so they agree to a float32 ulp."""
    from paged_llm.ops.elementwise import reference as ref
    from paged_llm.ops.elementwise import triton as tri

    hq, _, d = plan.kernel_heads
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(7, hq * d, generator=gen)).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hq * d, generator=gen)).to(device=device, dtype=dtype)
    angles = torch.rand(7, d // 2, generator=gen) * 6
    cos, sin = (f(torch.cat((angles, angles), -1)).to(device=device, dtype=dtype)
                for f in (torch.cos, torch.sin))  # fmt: skip
    q = x.view(7, hq, d)
    up = torch.randn(7, hq * d, generator=gen).to(device=device, dtype=dtype)
    # one rounding step of the dtype (interpreter runs truncate bf16: two)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    pairs = [
        ("rms_norm", tri.rms_norm_triton(x, w, 1e-6), ref.rms_norm_reference(x, w, 1e-6)),
        ("rotary", tri.rotary_triton(q, cos, sin), ref.rotary_reference(q, cos, sin)),
        ("silu_mul", tri.silu_mul_triton(x, up), ref.silu_mul_reference(x, up)),
    ]
    return [_compare(name, out, want, dtype, atol=tol, rtol=tol) for name, out, want in pairs]


def check_fp8_linear(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Fp8Linear against the dequantized weight in fp32 at decode (1 and 32 rows: the weight-only
    Triton kernel) and prefill (300 rows: torch._scaled_mm where the GPU has FP8, which rounds the
    activations to e4m3, hence a bound on the relative error norm)."""
    from paged_llm.quant.layers import Fp8Linear, fp8_matmul_supported

    if dtype == torch.float32:
        return []  # the FP8 path serves fp16/bf16 models
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(256, 384, bias=False)
    linear.weight.data = torch.randn(384, 256, generator=gen) / 16
    layer = Fp8Linear.from_float(linear).to(device)
    results = []
    for rows in (1, 32, 300):
        x = torch.randn(rows, 256, generator=gen).to(device=device, dtype=dtype)
        ref = x.float() @ layer.dequantize().t()
        out = layer.matmul(x).float()
        rel = float((out - ref).norm() / ref.norm())
        results.append({
            "check": f"fp8_linear_rows_{rows}",
            "dtype": str(dtype).removeprefix("torch."),
            "scaled_mm": fp8_matmul_supported(device),
            "relative_error": rel,
            "pass": bool(torch.isfinite(out).all()) and rel < 0.05,
        })  # fmt: skip
    return results


def section_kernels(plan: Plan, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Kernel correctness in every planned dtype, while time allows."""
    checks, skipped = [], []
    for name in plan.kernel_dtypes:
        if deadline.left() <= 0:
            skipped.append(name)
            continue
        checks.extend(kernel_checks(plan, device, DTYPE_NAMES[name]))
    failed = [f"{c['check']}/{c['dtype']}" for c in checks if not c["pass"]]
    return {
        "checks": checks,
        "all_pass": not failed and not skipped,
        "failed": failed,
        "skipped_dtypes": skipped,
    }


# ---- 3. decode attention bandwidth -------------------------------------------------------------
def decode_setup(batch, context, block_size, heads, dtype, device, shuffled=True):
    """Caches holding ``batch`` sequences of ``context`` tokens, and their decode inputs."""
    hq, hkv, d = heads
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks) if shuffled else torch.arange(num_blocks)
    tables = order.view(batch, per_seq).to(device=device, dtype=torch.int32)
    k = torch.empty(num_blocks, block_size, hkv, d, device=device, dtype=dtype).normal_()
    v = torch.empty_like(k).normal_()
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, tables, lens


def kv_bytes_read(batch: int, context: int, heads: tuple[int, int, int], dtype) -> int:
    """Bytes of K and V a decode step reads: every cached vector of every sequence, once."""
    _, hkv, d = heads
    return 2 * batch * context * hkv * d * torch.empty((), dtype=dtype).element_size()


def section_decode_bandwidth(
    plan: Plan, device: torch.device, deadline: Deadline, copy_bw: float | None
) -> dict[str, Any]:
    """Achieved K/V read bandwidth of the paged decode kernel, and its share of copy bandwidth."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, skipped = [], []
    for bs in plan.block_sizes:
        for batch in plan.decode_batches:
            for ctx in plan.decode_contexts:
                if deadline.left() <= 0:
                    skipped.append({"block_size": bs, "batch": batch, "context": ctx})
                    continue
                t = _time_decode(batch, ctx, bs, plan, dtype, device, shuffled=True)
                nbytes = kv_bytes_read(batch, ctx, plan.attn_heads, dtype)
                bw = nbytes / t / 1e9
                rows.append(
                    {
                        "block_size": bs,
                        "batch": batch,
                        "context": ctx,
                        "seconds": t,
                        "kv_bytes": nbytes,
                        "achieved_GBps": bw,
                        "fraction_of_copy_bw": bw / copy_bw if copy_bw else None,
                    }
                )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "dtype": dtype,
        "heads": plan.attn_heads,
        "copy_bandwidth_GBps": copy_bw,
        "rows": rows,
        "skipped": skipped,
    }


def _time_decode(batch, context, block_size, plan, dtype, device, shuffled) -> float:
    """Seconds per paged decode attention call over ``batch`` sequences of ``context`` tokens."""
    from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton

    q, k, v, tables, lens = decode_setup(
        batch, context, block_size, plan.attn_heads, dtype, device, shuffled
    )
    out = torch.empty_like(q)
    scale = plan.attn_heads[2] ** -0.5
    return time_op(
        lambda: paged_decode_attention_triton(
            q, k, v, tables, lens, scale, max_seq_len=context, out=out
        ),
        device,
        plan.timing_reps,
        graph=True,
    )


# ---- 4. Fig. 18a: paged vs contiguous kernel latency -------------------------------------------
def _time_sdpa(batch, context, plan, dtype, device) -> float:
    """Seconds per torch SDPA decode call over a contiguous [B, H, L, D] cache (the layout of
    FasterTransformer-style systems: the same math with no block table)."""
    import torch.nn.functional as F

    hq, hkv, d = plan.attn_heads
    q = torch.randn(batch, hq, 1, d, device=device, dtype=dtype)
    k = torch.randn(batch, hkv, context, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    gqa = {"enable_gqa": True} if hkv != hq else {}
    return time_op(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, **gqa),
        device,
        plan.timing_reps,
        graph=True,
    )


def section_fig18a(plan: Plan, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Decode attention latency: paged (shuffled blocks) vs in-order blocks vs contiguous SDPA."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bs = 16
    rows, skipped = [], []
    for batch in plan.fig18_batches:
        for ctx in plan.fig18_contexts:
            if deadline.left() <= 0:
                skipped.append({"batch": batch, "context": ctx})
                continue
            row: dict[str, Any] = {"batch": batch, "context": ctx, "block_size": bs}
            for layout, shuffled in (("paged", True), ("paged_in_order", False)):
                t = _time_decode(batch, ctx, bs, plan, dtype, device, shuffled)
                row[f"{layout}_us"] = 1e6 * t
            row["contiguous_sdpa_us"] = 1e6 * _time_sdpa(batch, ctx, plan, dtype, device)
            row["paged_over_sdpa"] = row["paged_us"] / row["contiguous_sdpa_us"]
            row["paged_over_in_order"] = row["paged_us"] / row["paged_in_order_us"]
            rows.append(row)
    return {
        "dtype": dtype,
        "heads": plan.attn_heads,
        "rows": rows,
        "skipped": skipped,
        "paper": "Fig. 18a: vLLM's paged kernel is 20-26% slower than FasterTransformer's",
    }


# ---- 5. end-to-end throughput ------------------------------------------------------------------
@dataclass
class Workload:
    """Prompt token ids and the output length each request must produce."""

    prompts: list[list[int]]
    output_lens: list[int]
    source: str

    def head(self, n: int) -> Workload:
        """The first n requests."""
        return Workload(self.prompts[:n], self.output_lens[:n], self.source)

    @property
    def output_tokens(self) -> int:
        """Total requested output tokens."""
        return sum(self.output_lens)


def build_workload(plan: Plan, vocab_size: int, trace: str | None, seed: int = 0) -> Workload:
    """ShareGPT-shaped lengths (the trace, or the synthetic log-normal fit), random prompt ids."""
    from paged_llm.workloads import lengths as wl

    if trace:
        pool = wl.filter_total_below(wl.load_length_csv(trace), wl.PAPER_MAX_TOTAL)
        pairs, source = wl.sample_pairs(pool, plan.num_requests, seed), f"trace:{trace}"
    else:
        pairs, source = wl.synthetic_lengths(plan.num_requests, seed), "synthetic"
    pairs = wl.scale_to_max_total(pairs, plan.max_total)
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(vocab_size) for _ in range(p.input_len)] for p in pairs]
    return Workload(prompts, [p.output_len for p in pairs], source)


def save_tiny_llama(out_dir: Path, max_positions: int = 128) -> Path:
    """A tiny random transformers Llama (smoke mode: both engines load the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        architectures=["LlamaForCausalLM"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(out_dir))
    return out_dir


def run_ours(
    engine: Any, work: Workload, deadline: Deadline, output_kind: str = "cumulative"
) -> dict[str, Any]:
    """Greedy, EOS-ignoring generation of every request through the engine's step loop, stopped
    (and the rest aborted) at the deadline; throughput over what was generated.

    ``output_kind``: ``cumulative`` (LLMEngine.step's default: every step returns each running
    request's tokens so far; runs 1-15 measured this) or ``final_only`` (``LLM.generate``'s,
    as vLLM's offline throughput benchmark runs: outputs only at the finish)."""
    from paged_llm import SamplingParams
    from paged_llm.core.request import PLACEHOLDER_TOKEN
    from paged_llm.sampling_params import RequestOutputKind

    kind = {"cumulative": RequestOutputKind.CUMULATIVE,
            "final_only": RequestOutputKind.FINAL_ONLY}[output_kind]  # fmt: skip
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=kind)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    progress: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    first_step = len(engine.iteration_stats)
    runner = engine.runner
    by_kind: dict[str, list[float]] = {}  # forward kind -> wall seconds of each such step
    start = time.perf_counter()
    while engine.has_unfinished_requests() and deadline.left() > 0:
        runner.last_forward_kind = None
        step_start = time.perf_counter()
        step_outputs = engine.step()
        by_kind.setdefault(runner.last_forward_kind or "none", []).append(
            time.perf_counter() - step_start
        )
        for out in step_outputs:
            progress[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    unfinished = [f"r{i}" for i in range(len(work.prompts)) if f"r{i}" not in outputs]
    for rid in unfinished:  # what they generated by the deadline (final-only outputs had none)
        group = engine.outputs.groups.get(rid)
        if group is not None:  # async scheduling: a token still on the device is not counted
            ids = group.members[0].request.output_token_ids
            progress[rid] = len(ids) - ids[-1:].count(PLACEHOLDER_TOKEN)
    engine.abort_request(unfinished)
    running = [s.num_running for s in engine.iteration_stats[first_step:] if s.num_running]
    generated = sum(progress.values())
    return {
        "requests": len(work.prompts),
        "output_kind": output_kind,
        "finished": len(outputs),
        "partial": bool(unfinished),
        "elapsed_s": elapsed,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "mean_running_batch": statistics.mean(running) if running else 0.0,
        "steps": len(engine.iteration_stats) - first_step,
        # Where the time went: steps by how the forward ran (CUDA graph replay, eager decode,
        # eager with prompt tokens), their count, total and median wall time (engine.step()).
        "steps_by_kind": {
            kind: {"steps": len(t), "total_s": sum(t), "median_ms": 1e3 * statistics.median(t)}
            for kind, t in sorted(by_kind.items())
        },
        "outputs": [outputs.get(f"r{i}") for i in range(len(work.prompts))],
    }


def probe_static_batch(model: Any, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) of ``generate`` on one batch, from two timed
    runs of 2 and 2 + n new tokens after an untimed warm-up (CUDA / cuBLAS initialisation)."""
    from experiments.hf_baselines import generate_static_batch

    generate_static_batch(model, prompts, [2] * len(prompts))
    times = []
    for steps in (2, 2 + n):
        start = time.perf_counter()
        generate_static_batch(model, prompts, [steps] * len(prompts))
        times.append(time.perf_counter() - start)
    per_step = max((times[1] - times[0]) / n, 1e-6)
    return max(times[0] - 2 * per_step, 0.0), per_step


def run_hf_static(model: Any, work: Workload, batch_size: int, deadline: Deadline) -> dict:
    """transformers ``generate`` in static batches (workload order), while batches fit the time
    left: each batch's time (prefill + longest output x per-step time) is predicted from a probe
    and refined after every batch."""
    from experiments.hf_baselines import generate_static_batch

    done, tokens, elapsed = 0, 0, 0.0
    outputs: list[list[int]] = []
    stop_reason = "all batches done"
    prefill_s, per_step = probe_static_batch(model, work.prompts[:batch_size], 16)
    probe = {"prefill_s": prefill_s, "per_step_s": per_step}
    for lo in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[lo : lo + batch_size]
        outs = work.output_lens[lo : lo + batch_size]
        predicted = prefill_s + per_step * max(outs)
        if predicted * 1.05 > deadline.left():
            stop_reason = f"time: batch at request {lo} would take ~{predicted:.0f} s"
            break
        start = time.perf_counter()
        batch_out, _ = generate_static_batch(model, prompts, outs)
        took = time.perf_counter() - start
        per_step = max((took - prefill_s) / max(outs), 1e-6)
        elapsed += took
        done += len(prompts)
        tokens += sum(outs)  # each request's own output_len counts, not the padding steps
        outputs.extend(batch_out)
    result = {
        "batch_size": batch_size,
        "requests": done,
        "partial": done < len(work.prompts),
        "stop_reason": stop_reason,
        "probe": probe,
        "elapsed_s": elapsed,
        "generated_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed if elapsed else None,
        "outputs": outputs,
    }
    if not done:  # nothing fitted: a projection from the probe, labelled as one
        batches = range(0, len(work.prompts), batch_size)
        total = sum(prefill_s + probe["per_step_s"] * max(work.output_lens[b : b + batch_size])
                    for b in batches)  # fmt: skip
        result["projected_output_tokens_per_s"] = work.output_tokens / total
        result["projection"] = "not measured: prefill + longest output x probed step time"
    return result


def run_hf_generate_batch(model: Any, work: Workload, deadline: Deadline) -> dict[str, Any]:
    """transformers continuous batching (the manager behind ``generate_batch``), per-request
    ``max_new_tokens``, stopped at the deadline."""
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    from experiments.hf_baselines import _greedy_config, cb_config_for, quiet_cb_logs

    cb = cb_config_for(
        work.prompts,
        work.output_lens,
        page_size=16,
        max_batch_tokens=2048,
        max_requests_per_batch=256,
        num_blocks=None,
    )
    gen_config = _greedy_config(max(work.output_lens), pad_token_id=0)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in work.prompts),
        max_generated_length=max(work.output_lens),
        num_requests=len(work.prompts),
    )
    results: dict[str, list[int]] = {}
    with quiet_cb_logs():
        manager_cm = model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=cb,
            block=True,
            timeout=5,
            workload_hints=hints,
        )
        with manager_cm as manager:
            start = time.perf_counter()
            ids = [
                manager.add_request(
                    list(p), request_id=f"req_{i}", max_new_tokens=n, eos_token_id=-1
                )
                for i, (p, n) in enumerate(zip(work.prompts, work.output_lens))
            ]
            while len(results) < len(ids) and deadline.left() > 0:
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                    results[r.request_id] = list(r.generated_tokens)
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
            elapsed = time.perf_counter() - start
    outputs = [results[i][:n] if i in results else None for i, n in zip(ids, work.output_lens)]
    tokens = sum(len(o) for o in outputs if o is not None)
    return {
        "requests": len(ids),
        "finished": len(results),
        "partial": len(results) < len(ids),
        "elapsed_s": elapsed,
        "generated_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "outputs": outputs,
    }


def bandwidth_bound(
    hf_config: Any, dtype: torch.dtype, bw_GBps: float, batch: float, context: float
) -> float:
    """Decode tokens/s if every step only had to read the weights once and each sequence's
    K/V: B x BW / (weight bytes + B x context x KV bytes per token)."""
    sizes = bound_bytes(hf_config, dtype)
    return batch * bw_GBps * 1e9 / (sizes["weights"] + batch * context * sizes["kv_per_token"])


def bound_bytes(hf_config: Any, dtype: torch.dtype) -> dict[str, float]:
    """The bound's terms: the weights' bytes and the K/V bytes of one token (all layers)."""
    from paged_llm.models.base import head_dim_of, num_kv_heads_of
    from paged_llm.models.presets import count_parameters

    elem = torch.empty((), dtype=dtype).element_size()
    kv_per_token = (
        2 * hf_config.num_hidden_layers * num_kv_heads_of(hf_config) * head_dim_of(hf_config) * elem
    )
    return {"weights": count_parameters(hf_config) * elem, "kv_per_token": kv_per_token}


def _attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or a record of its error."""
    try:
        return fn()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=6)}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_steps(engine: Any, work: Workload, out_dir: Path, steps: int = 6) -> dict[str, Any]:
    """torch.profiler over a few engine steps (a prefill-carrying step, then decodes) of 64
    requests; the op tables go to ``profile_steps.txt`` in ``out_dir``."""
    from torch.profiler import ProfilerActivity, profile

    from paged_llm import SamplingParams

    head = work.head(64)
    ids = [f"profile-{i}" for i in range(len(head.prompts))]
    for rid, prompt in zip(ids, head.prompts):
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    cuda = torch.cuda.is_available()
    kinds, times = [], []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            kinds.append(engine.runner.last_forward_kind)
    engine.abort_request(ids)
    path = out_dir / "profile_steps.txt"
    write_profile_tables(prof, path, cuda)
    return {"file": path.name, "step_kinds": kinds, "step_ms": [1e3 * t for t in times]}


def write_profile_tables(prof: Any, path: Path, cuda: bool) -> None:
    """torch.profiler's op table sorted by self CPU time, and by self CUDA time on CUDA."""
    table = prof.key_averages()
    sort_keys = ["self_cpu_time_total"] + (["self_cuda_time_total"] if cuda else [])
    path.write_text(
        "\n\n".join(f"sorted by {k}\n{table.table(sort_by=k, row_limit=30)}" for k in sort_keys)
    )


def engine_kwargs(plan: Plan, device: torch.device) -> dict[str, Any]:
    """The engine arguments of the end-to-end runs (also experiments/gpu_e2e_variants.py)."""
    kwargs: dict[str, Any] = dict(
        dtype=plan.dtype,
        max_num_seqs=plan.max_num_seqs,
        seed=0,
        max_model_len=plan.max_total,
        max_num_batched_tokens=max(4096, plan.max_total),
        device=str(device),
        plugins=["paged_llm.engine.profile.StepPhaseProfile"],  # where step time goes
    )
    if device.type == "cpu":
        kwargs["cpu_kv_cache_gib"] = 0.05
    return kwargs


def _attempt_engine(
    plan: Plan,
    device: torch.device,
    model_dir: Path | None,
    work: Workload,
    subset: Workload,
    share: Callable[[float], Deadline],
    result: dict[str, Any],
    profile_dir: Path | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This engine on all requests, then on the generate_batch subset; freed afterwards.

    With CUDA graphs on a GPU (a failed capture leaves the engine eager and is recorded); if
    building fails anyway, the error is recorded and the engine is rebuilt with
    ``enforce_eager``, so the throughput is still measured.
    """
    from paged_llm import LLM, SamplingParams

    start = time.perf_counter()
    kwargs = engine_kwargs(plan, device)
    model_arg = str(model_dir) if model_dir else plan.model
    try:
        llm = LLM(model_arg, **kwargs)
    except Exception as err:
        if device.type != "cuda":
            raise
        result["engine_error"] = f"{type(err).__name__}: {err}"
        _free(device)
        llm = LLM(model_arg, enforce_eager=True, **kwargs)
    result["cuda_graphs"] = llm.llm_engine.runner.cuda_graphs is not None
    if llm.llm_engine.runner.cuda_graph_error:  # the engine fell back to eager steps
        result["cuda_graph_error"] = llm.llm_engine.runner.cuda_graph_error
    result["engine_build_s"] = time.perf_counter() - start
    result["kv_cache_tokens"] = llm.llm_engine.kv_cache_tokens
    warm = work.head(plan.warmup_requests)  # compiles the Triton kernels before timing
    llm.generate(
        [{"prompt_token_ids": p} for p in warm.prompts],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    phases = llm.llm_engine.core.plugins[-1]
    phases.reset()  # the timed run only
    ours = run_ours(llm.llm_engine, work, share(0.45))
    result["step_phases"] = phases.summary()
    ours_subset = run_ours(llm.llm_engine, subset, share(0.2))
    if profile_dir is not None:
        result["profile"] = _attempt(partial(profile_steps, llm.llm_engine, work, profile_dir))
    llm.shutdown()
    del llm
    _free(device)
    if device.type == "cuda":  # what the engine left behind (should be ~0) before transformers
        result["cuda_bytes_after_engine"] = torch.cuda.memory_allocated(device)
    return ours, ours_subset


def run_transformers(
    plan: Plan,
    device: torch.device,
    dtype: torch.dtype,
    hf_config: Any,
    model_dir: Path | None,
    work: Workload,
    subset: Workload,
    share: Callable[[float], Deadline],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """transformers' static generate on all requests and generate_batch on the subset, each
    recorded on its own (one that fails, say on an older transformers, keeps the other).

    Smoke mode loads the engine's own checkpoint; otherwise a random model of the same shape.
    """
    from transformers import AutoModelForCausalLM

    if model_dir is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    else:
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    hf = hf.to(device)
    static = _attempt(lambda: run_hf_static(hf, work, plan.hf_batch_size, share(0.6)))
    cb = _attempt(lambda: run_hf_generate_batch(hf, subset, share(1.0)))
    return static, cb


def section_end_to_end(
    plan: Plan,
    device: torch.device,
    deadline: Deadline,
    copy_bw: float | None,
    trace: str | None,
    workdir: Path,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """This engine vs transformers generate / generate_batch, and vs the bandwidth bound."""
    from paged_llm.models import presets
    from paged_llm.models.loader import load_config

    dtype = DTYPE_NAMES.get(plan.dtype) or getattr(torch, plan.dtype)
    model_dir = save_tiny_llama(workdir / "tiny-llama") if plan.model == "tiny-llama" else None
    hf_config = load_config(model_dir) if model_dir else presets.preset_config(plan.model)
    work = build_workload(plan, hf_config.vocab_size, trace)
    subset = work.head(plan.hf_subset)
    result: dict[str, Any] = {
        "model": plan.model,
        "dtype": dtype,
        "device": str(device),
        "workload": {
            "source": work.source,
            "requests": len(work.prompts),
            "input_tokens": sum(map(len, work.prompts)),
            "output_tokens": work.output_tokens,
            "max_total": plan.max_total,
        },
    }
    # Time shares of what is left: ours on everything, ours on the subset, HF static, HF CB.
    share = lambda frac: Deadline.after(max(1.0, deadline.left() * frac))  # noqa: E731

    ours, ours_subset = _attempt_engine(
        plan, device, model_dir, work, subset, share, result, profile_dir
    )
    static, cb = run_transformers(plan, device, dtype, hf_config, model_dir, work, subset, share)
    _free(device)

    # -- comparisons (only over requests both sides finished where outputs are compared)
    n = min(static.get("requests", 0), ours["finished"])
    if model_dir is not None and n:  # identical weights: greedy tokens must agree
        pairs = [(a, b) for a, b in zip(ours["outputs"][:n], static["outputs"][:n]) if a]
        result["tokens_match_generate"] = all(a == b for a, b in pairs) if pairs else None
    for run in (ours, ours_subset, static, cb):
        run.pop("outputs", None)
    result.update(
        ours=ours,
        ours_on_generate_batch_requests=ours_subset,
        hf_generate=static,
        hf_generate_batch=cb,
    )
    if static.get("output_tokens_per_s"):
        result["speedup_vs_generate"] = ours["output_tokens_per_s"] / static["output_tokens_per_s"]
    if cb.get("output_tokens_per_s"):
        result["speedup_vs_generate_batch"] = (
            ours_subset["output_tokens_per_s"] / cb["output_tokens_per_s"]
        )
    if copy_bw:
        mean_in = sum(map(len, work.prompts)) / len(work.prompts)
        context = mean_in + statistics.mean(work.output_lens) / 2  # mean context while decoding
        batch = ours["mean_running_batch"] or 1.0
        bound = bandwidth_bound(hf_config, dtype, copy_bw, batch, context)
        result["bandwidth_bound"] = {
            "formula": "B x BW / (weight bytes + B x context x KV bytes per token)",
            "batch": batch,
            "context": context,
            "bandwidth_GBps": copy_bw,
            "output_tokens_per_s": bound,
            "ours_fraction": ours["output_tokens_per_s"] / bound,
            "at_max_num_seqs_tokens_per_s": bandwidth_bound(
                hf_config, dtype, copy_bw, plan.max_num_seqs, context
            ),
        }
    return result


# ---- targets and main --------------------------------------------------------------------------
def evaluate_targets(sections: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
    """The issue's acceptance targets, from the measured sections (None: not measured; always
    None for a CPU smoke run, whose numbers say nothing about a GPU)."""
    if not on_gpu:
        return {"note": "CPU smoke run: the targets apply to GPU runs only", "pass": None}
    rows = sections.get("decode_bandwidth", {}).get("rows", [])
    relevant = [
        r
        for r in rows
        if r["context"] >= 2048 and r["batch"] >= 32 and r["fraction_of_copy_bw"] is not None
    ]
    worst = min((r["fraction_of_copy_bw"] for r in relevant), default=None)
    e2e = sections.get("end_to_end", {})
    vs_gen, vs_batch = e2e.get("speedup_vs_generate"), e2e.get("speedup_vs_generate_batch")
    kernels = sections.get("kernels", {})
    return {
        "kernels_match_reference": kernels.get("all_pass"),
        "sleep_and_offload_keep_outputs": sections.get("sleep_offload", {}).get("all_pass"),
        "fp32_greedy_identical_to_transformers": sections.get("parity", {}).get(
            "fp32_all_identical"
        ),
        "decode_attention_ge_80pct_copy_bw": {
            "worst_fraction": worst,
            "pass": None if worst is None else worst >= 0.8,
            "over": "context >= 2048 and batch >= 32",
        },
        "e2e_ge_10x_generate": {
            "speedup": vs_gen,
            "pass": None if vs_gen is None else vs_gen >= 10,
        },
        "e2e_ge_2x_generate_batch": {
            "speedup": vs_batch,
            "pass": None if vs_batch is None else vs_batch >= 2,
        },
    }


def device_info(device: torch.device) -> dict[str, Any]:
    """What ran the check."""
    info: dict[str, Any] = {
        "type": device.type,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            name=p.name,
            total_memory_GiB=p.total_memory / 2**30,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
        )
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check; return the JSON document (also written to ``--out``/gpu_check.json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller sweeps, 200 requests")
    mode.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (for tests)")
    parser.add_argument("--out", default="outputs/gpu_check", help="directory for the JSON")
    parser.add_argument(
        "--trace",
        default=os.environ.get("PAGED_LLM_SHAREGPT_TRACE"),
        help="CSV of input_len,output_len (default: synthetic ShareGPT lengths)",
    )
    parser.add_argument(
        "--spec-models",
        help="spec_decode's models, from `python -m experiments.gpu_spec_decode --export DIR` "
        "(default .gpu_inputs/spec_models)",
    )
    parser.add_argument("--budget", type=float, help="override the plan's budget in seconds")
    parser.add_argument(
        "--extras",
        action="store_true",
        help=f"also run {', '.join(EXTRA_SECTIONS)} (their caps are added to the budget)",
    )
    parser.add_argument(
        "--cap",
        action="append",
        default=[],
        metavar="SECTION=SECONDS",
        help="override one section's time cap (repeatable), e.g. --cap parity=120",
    )
    parser.add_argument(
        "--only",
        help=f"comma-separated sections to run (bandwidth always runs): {', '.join(SECTIONS)}",
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    plan = PLANS["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.budget:
        plan = replace(plan, budget_s=args.budget)
    if args.cap:
        plan = replace(plan, section_s={**plan.section_s, **parse_caps(args.cap)})
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs Triton's CPU interpreter: set TRITON_INTERPRET=1")
        device = torch.device("cpu")
        # Tiny shapes gain nothing from threads, and busy-waiting OpenMP threads on shared
        # cores slow every op down many times over.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run_check(args, plan, device)
        finally:
            torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    return run_check(args, plan, torch.device("cuda"))


def parse_caps(items: list[str]) -> dict[str, float]:
    """``["parity=120", ...]`` -> {"parity": 120.0}; a clear error for anything else."""
    caps = {}
    for item in items:
        name, sep, seconds = item.partition("=")
        if not sep or name not in SECTIONS:
            raise SystemExit(f"--cap wants SECTION=SECONDS with a section of {SECTIONS}: {item!r}")
        try:
            caps[name] = float(seconds)
        except ValueError:
            raise SystemExit(f"--cap {item!r}: {seconds!r} is not a number of seconds") from None
    return caps


def run_check(args: argparse.Namespace, plan: Plan, device: torch.device) -> dict[str, Any]:
    """Run every section on ``device``; write and return the JSON document."""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    report = Report(
        out_dir / "gpu_check.json",
        {
            "schema": SCHEMA,
            "mode": plan.mode,
            "measured": device.type == "cuda",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m experiments.gpu_check", *args.argv]),
            "device": device_info(device),
            "versions": {
                "torch": torch.__version__,
                "triton": triton.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "cuda": torch.version.cuda,
            },
            "plan": asdict(plan),
            "sections": {},
        },
    )
    from experiments.gpu_memory_features import section_sleep_offload
    from experiments.gpu_parity import section_parity
    from experiments.gpu_spec_decode import section_spec_decode
    from experiments.gpu_sweeps import section_kernel_sweep, section_quant_decode

    chosen = selected_sections(args)
    budget = Budget(
        plan.budget_s + sum(plan.section_s[name] for name in EXTRA_SECTIONS if name in chosen)
    )
    cap = plan.section_s
    # Every later section compares with the copy bandwidth, so it is always measured first.
    bw = run_section(
        report,
        "bandwidth",
        budget,
        cap["bandwidth"],
        1,
        lambda d: section_bandwidth(plan, device, d),
    )
    copy_bw = bw.get("copy_bandwidth_GBps")
    workdir = tempfile.TemporaryDirectory(prefix="gpu_check-")
    sections: list[tuple[str, float, Callable[[Deadline], dict[str, Any]]]] = [
        ("kernels", 2, lambda d: section_kernels(plan, device, d)),
        ("parity", 2, lambda d: section_parity(plan, device, d, Path(workdir.name))),
        ("kernel_sweep", 2, lambda d: section_kernel_sweep(plan, device, d, copy_bw)),
        ("decode_bandwidth", 2, lambda d: section_decode_bandwidth(plan, device, d, copy_bw)),
        ("fig18a", 2, lambda d: section_fig18a(plan, device, d)),
        ("end_to_end", min(30, cap["end_to_end"]), lambda d: section_end_to_end(
            plan, device, d, copy_bw, args.trace, Path(workdir.name), out_dir)),
        ("quant_decode", min(20, cap["quant_decode"]),
         lambda d: section_quant_decode(plan, device, d, copy_bw)),
        ("sleep_offload", min(20, cap["sleep_offload"]),
         lambda d: section_sleep_offload(plan, device, d, Path(workdir.name))),
        ("spec_decode", min(20, cap["spec_decode"]),
         lambda d: section_spec_decode(plan, device, d, args.spec_models)),
    ]  # fmt: skip
    with workdir:
        for name, min_s, fn in sections:
            if name in chosen:
                run_section(report, name, budget, cap[name], min_s, fn)
    report.doc["targets"] = evaluate_targets(report.doc["sections"], device.type == "cuda")
    report.doc["elapsed_s"] = round(time.perf_counter() - budget.start, 2)
    report.write()
    print(f"[gpu_check] wrote {report.path}", flush=True)
    return report.doc


if __name__ == "__main__":
    main()
