"""Where a decode step's device time goes, by kernel kind, beside the step's bandwidth bound.

Issue 39 asks where the rest of the bound goes. ``StepPhaseProfile`` splits a step's wall time
among host phases; this splits the device's part. :func:`profile_step_shape` fills a running
engine with ``batch`` requests whose context is ``context`` tokens, lets them reach steady
decoding (CUDA graph replays on a GPU), profiles ``steps`` decode steps and then one step with a
``mixed_prompt``-token prompt beside them, and sums the kernels' device time by kind:

* ``gemm`` (cuBLAS / cuBLASLt / CUTLASS kernels, the Triton quantized matmuls) against
  ``weights_ms`` (the weights read once at the copy bandwidth);
* ``attention`` (the paged decode / prefill kernels) against ``kv_ms`` (each sequence's K/V
  read once);
* ``kv_store``, ``norm_rope_act`` (the fused RMSNorm, rotary, SiLU-and-mul kernels), ``torch
  elementwise`` (residual adds and other aten kernels), ``sampling``, ``memory`` (copies and
  sets) and ``other``;

with ``busy_ms`` (all kernels) against ``wall_ms`` (``engine.step()``): the difference is the
time the device waited for the host. On the CPU (``--smoke`` runs) there are no device kernels,
and the same sums are taken over the profiler's CPU operators (self time), which says where a
CPU step goes instead.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

KINDS: list[tuple[str, re.Pattern[str]]] = [
    # order matters: the first match wins
    ("attention", re.compile(r"paged_decode|paged_prefill|reduce_splits|flash|attention", re.I)),
    ("kv_store", re.compile(r"store_kv|kv_store", re.I)),
    ("norm_rope_act", re.compile(r"rms_norm|rotary|silu_mul|layer_norm|gelu", re.I)),
    (
        "gemm",
        re.compile(
            r"nvjet|gemm|gemv|cutlass|cublas|xmma|splitK|_matmul|aten::mm$|aten::addmm|"
            r"aten::linear|mkldnn|onednn",
            re.I,
        ),
    ),
    (
        "sampling",
        re.compile(r"argmax|softmax|sort|topk|multinomial|exponential|reduce_kernel", re.I),
    ),
    ("memory", re.compile(r"memcpy|memset|aten::copy_|aten::index|gather|scatter", re.I)),
    ("torch_elementwise", re.compile(r"elementwise|aten::", re.I)),
]


def kind_of(name: str) -> str:
    """The kind a kernel (or, on the CPU, an operator) is counted under."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def device_times(prof: Any) -> tuple[str, list[tuple[str, float]]]:
    """("device", [(kernel name, us)]) from a torch.profiler run that traced CUDA kernels, or
    ("cpu", [(operator name, self us)]) where it traced none."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernels = [(e.name, e.time_range.elapsed_us()) for e in events
               if e.device_type == DeviceType.CUDA]  # fmt: skip
    if kernels:
        return "device", kernels
    return "cpu", [(e.name, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0]


def summarise(
    timed: list[tuple[str, float]], steps: int, wall_s: list[float], top: int = 12
) -> dict[str, Any]:
    """ms per step by kind, the busiest names, and busy against wall time."""
    by_name: dict[str, list[float]] = {}
    for name, us in timed:
        by_name.setdefault(name, []).append(us)
    by_kind: dict[str, float] = {}
    for name, t in by_name.items():  # each name's kind matched once, not once per launch
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + sum(t)
    busiest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "steps": steps,
        "ms_per_step": {k: v / 1e3 / steps for k, v in sorted(by_kind.items())},
        "busy_ms": sum(by_kind.values()) / 1e3 / steps,
        "wall_ms": 1e3 * statistics.median(wall_s) if wall_s else None,
        "busiest": [
            {"name": name[:120], "calls_per_step": len(t) / steps, "us_each": statistics.mean(t)}
            for name, t in busiest
        ],
    }


def _profiled_steps(engine: Any, steps: int) -> tuple[str, list[tuple[str, float]], list[float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        if cuda:
            torch.cuda.synchronize()
    source, timed = device_times(prof)
    return source, timed, walls


def profile_step_shape(
    engine: Any,
    batch: int,
    context: int,
    vocab_size: int,
    bytes_per_step: dict[str, float],
    copy_GBps: float,
    steps: int = 8,
    mixed_prompt: int = 480,
    seed: int = 0,
) -> dict[str, Any]:
    """Profile ``steps`` decode steps of ``batch`` sequences at ``context`` tokens, then one
    step with a ``mixed_prompt``-token prompt beside them, in ``engine`` (idle on entry, idle
    on return). ``bytes_per_step``: ``weights`` and ``kv_per_token`` bytes (the bound's terms)."""
    import random

    from paged_llm import SamplingParams

    rng = random.Random(seed)
    warm = 4  # decode steps before profiling: graphs replay, the scheduler settles
    limit = engine.max_model_len - warm - steps - 8  # room for every token it generates
    context = max(1, min(context, limit))
    mixed_prompt = max(1, min(mixed_prompt, engine.max_model_len - 1))
    prompt_len = max(1, context - steps // 2)  # mean context over the profiled steps
    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 8, ignore_eos=True)
    ids = [f"kernel-profile-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    runner = engine.runner
    for _ in range(10_000):  # prefill every prompt, then a few decodes
        engine.step()
        decoding = runner.last_forward_kind in ("graph", "eager_decode")
        if decoding and not engine.scheduler.waiting:
            break
    for _ in range(warm):
        engine.step()
    running = len(engine.scheduler.running)  # the batch the profiled steps decode
    source, timed, walls = _profiled_steps(engine, steps)
    decode = summarise(timed, steps, walls)
    decode["last_kind"] = runner.last_forward_kind  # "graph" on a GPU, "eager_decode" on a CPU
    # one step with a prompt beside the decodes
    extra = "kernel-profile-mixed"
    prompt = [rng.randrange(vocab_size) for _ in range(mixed_prompt)]
    greedy_one = SamplingParams(temperature=0.0, max_tokens=1)  # greedy, as the others
    engine.add_request(extra, {"prompt_token_ids": prompt}, greedy_one)
    _, mixed_timed, mixed_walls = _profiled_steps(engine, 1)
    mixed = summarise(mixed_timed, 1, mixed_walls)
    mixed["kind"] = runner.last_forward_kind
    engine.abort_request(ids + [extra])
    weights_ms = bytes_per_step["weights"] / (copy_GBps * 1e9) * 1e3
    kv_ms = batch * context * bytes_per_step["kv_per_token"] / (copy_GBps * 1e9) * 1e3
    return {
        "what": "real engine steps under torch.profiler (not simulated)",
        "source": source,  # "device": kernel times; "cpu": operator self times
        "batch": batch,
        "running": running,
        "context": context,
        "mixed_prompt": mixed_prompt,
        "bound_ms": {"weights_ms": weights_ms, "kv_ms": kv_ms, "step_ms": weights_ms + kv_ms},
        "decode": decode,
        "mixed": mixed,
    }
