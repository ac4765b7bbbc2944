"""The GPU check's end-to-end workload under engine variants, in one process, one after the
other: where issue 39's changes move the fraction of the bandwidth bound.

    python3 -m experiments.gpu_e2e_variants --out $OUT                # ~5 min on an H200
    python3 -m experiments.gpu_e2e_variants --smoke --out /tmp/e2e    # CPU, tiny, interpreter

Variants (``VARIANTS``; ``--variants`` picks some), each a fresh engine on the same requests:

* ``decode_graphs`` (not run by default): CUDA graphs for decode steps only
  (``cudagraph_mode=FULL_DECODE_ONLY``), as the engine ran on the H200 in run 11 (0.33 of the
  bound): the peer of the mixed-step graphs;
* ``mixed_graphs``: steps with prompt tokens replay graphs too (``FULL``, the default);
* ``mixed_graphs_async`` (not run by default): and async output processing
  (``async_output_proc=True``);
* ``mixed_graphs_async_sched``: and async scheduling instead (``async_scheduling=True``: step
  N + 1 planned, built and launched while the GPU runs step N; outputs a step later);
* ``mixed_graphs_unmerged``: ``mixed_graphs`` with q/k/v and gate/up as
  separate GEMMs (``merge_sibling_linears=False``), as every run before 2026-12-06 ran them;
* ``mixed_graphs_final_only`` (not run by default): ``mixed_graphs`` with outputs read as
  ``LLM.generate`` (and vLLM's offline throughput benchmark) reads them, only at the finish,
  instead of every running request's tokens so far after every step.

For each: output tokens/s and its fraction of the bound B x BW / (weight bytes + B x context x
KV bytes per token) (BW measured first in the same run), steps by how they ran
(``steps_by_kind``: ``graph``, ``graph_mixed``, ``eager_prefill``, ...), the step's time by
engine phase (``step_phases``), host syncs per step (``syncs_per_step``: CUDA's sync debug
mode over ``SYNC_STEPS`` steps, counting the warnings it raises; the sampled ids are one;
``syncs_per_step_sampled``: the same with top-p sampling and a repetition penalty) and
the share of requests whose greedy tokens equal the first variant's (bf16 on random weights:
a graph's varlen kernel and the eager decode kernel may round a near-tie differently), and
the host's speed before and after the variant (``host_probe_ms``: a pure-Python scheduler
step; variants compare only where it stayed put). For the variants in ``--kernel-profile``
(``mixed_graphs`` and ``mixed_graphs_unmerged`` by default), after the timed run and untimed:
``kernel_breakdown``, the device's time per decode step (and one mixed step) at the run's mean
batch and context by kernel kind (GEMMs against the weights' share of the bound, attention
against the K/V's, the fused elementwise kernels, ...; experiments/kernel_breakdown.py). The
JSON is rewritten after every variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from experiments.common.checkpoints import save_tiny_llama
from experiments.common.hardware import device_name
from experiments.common.timing import Deadline
from experiments.common.workloads import build_workload
from experiments.gpu.bandwidth import _time_copy
from experiments.gpu.end_to_end import _free, bandwidth_bound, bound_bytes, engine_kwargs, run_ours
from experiments.gpu.plans import DTYPE_NAMES, PLANS, Plan
from experiments.gpu.report import json_default
from experiments.kernel_breakdown import profile_step_shape

# engine arguments, and optionally how the loop reads outputs ("output_kind", run_ours': the
# default "cumulative", as runs 1-15 did, or "final_only", as LLM.generate and vLLM's offline
# throughput benchmark)
VARIANTS: dict[str, dict[str, Any]] = {
    "decode_graphs": {"cudagraph_mode": "FULL_DECODE_ONLY"},
    "mixed_graphs": {"cudagraph_mode": "FULL"},
    "mixed_graphs_async": {"cudagraph_mode": "FULL", "async_output_proc": True},
    "mixed_graphs_async_sched": {"cudagraph_mode": "FULL", "async_scheduling": True},
    "mixed_graphs_unmerged": {"cudagraph_mode": "FULL", "merge_sibling_linears": False},
    "mixed_graphs_final_only": {"cudagraph_mode": "FULL", "output_kind": "final_only"},
    # not run by default: graphs for steps of up to 2048 tokens (4x the graphs' captures)
    "mixed_graphs_2048": {"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 2048},
}
DEFAULT_VARIANTS = ("mixed_graphs", "mixed_graphs_async_sched", "mixed_graphs_unmerged")
SYNC_STEPS = 20  # steps watched by the sync debug mode (it slows them; not timed)


def host_probe_ms() -> float:
    """The host's Python speed now: median ms of a scheduler step (schedule + update) with 256
    running decodes, no device. Taken before and after each variant: in run 14 every host
    phase of the async variant ran ~55% slower than the variant before it (the host, not
    the variant), and run 15's host was 2-3x slower throughout."""
    from experiments.sched_overhead import measure

    return measure(num_running=256, iterations=40, policy="paged", block_size=16,
                   prompt_len=512, max_model_len=2048)["median_ms"]  # fmt: skip


def count_syncs(engine: Any, steps: int) -> dict[str, Any]:
    """Host syncs per step over ``steps`` steps of the engine's current requests (CUDA only:
    ``torch.cuda.set_sync_debug_mode`` warns on each synchronizing call)."""
    if not torch.cuda.is_available():
        return {"note": "CUDA only"}
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"steps": len(counts), "mean": statistics.mean(counts) if counts else None,
            "max": max(counts, default=None)}  # fmt: skip


def run_variant(
    name: str,
    plan: Plan,
    device: torch.device,
    model: str,
    work: Any,
    run_s: float,
    kernel_profile: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """One variant: build, warm up, count syncs, time the workload for at most ``run_s``
    seconds (from the timed run's start: building and compiling come first), then, with
    ``kernel_profile`` (``profile_step_shape``'s arguments but the batch), profile steps at the
    run's mean batch; (record, outputs)."""
    from paged_llm import LLM, SamplingParams

    probe = host_probe_ms()
    start = time.perf_counter()
    variant = dict(VARIANTS[name])
    output_kind = variant.pop("output_kind", "cumulative")
    kwargs = engine_kwargs(plan, device) | variant
    llm = LLM(model, **kwargs)
    engine = llm.llm_engine
    record: dict[str, Any] = {"engine_args": VARIANTS[name], "build_s": time.perf_counter() - start,
                              "cuda_graph_error": engine.runner.cuda_graph_error}  # fmt: skip
    warm = work.head(plan.warmup_requests)  # compiles the kernels before anything is timed
    # greedy (the timed workload's sampling), then sampled with top-p and a penalty: under
    # async scheduling neither should wait for the device beyond the sampled ids
    for key, params in (
        ("syncs_per_step", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
        ("syncs_per_step_sampled", SamplingParams(temperature=0.8, top_p=0.9, seed=0,
                                                  repetition_penalty=1.1, max_tokens=16,
                                                  ignore_eos=True)),
    ):  # fmt: skip
        for i, prompt in enumerate(warm.prompts):
            engine.add_request(f"{key}-warm{i}", {"prompt_token_ids": prompt}, params)
        record[key] = count_syncs(engine, SYNC_STEPS)
        while engine.has_unfinished_requests():
            engine.step()
    phases = engine.core.plugins[-1]
    phases.reset()
    deferred_before = engine.runner.deferred_steps
    ours = run_ours(engine, work, Deadline.after(run_s), output_kind)
    record["step_phases"] = phases.summary()
    # async scheduling: the timed steps whose sampled ids stayed on the device (the rest
    # sampled synchronously)
    record["deferred_steps"] = engine.runner.deferred_steps - deferred_before
    record["host_probe_ms"] = {"before": probe, "after": host_probe_ms()}
    outputs = ours.pop("outputs")
    record.update(ours)
    if kernel_profile is not None:  # untimed, after the run: the device's part of a step
        batch = max(1, round(ours["mean_running_batch"]))
        try:
            record["kernel_breakdown"] = profile_step_shape(engine, batch, **kernel_profile)
        except Exception as err:  # the variant's run still counts
            record["kernel_breakdown"] = {"error": f"{type(err).__name__}: {err}"}
    llm.shutdown()
    del llm, engine
    _free(device)
    return record, outputs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the variants; write ``gpu_e2e_variants.json`` under ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, interpreter")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for all variants")
    ap.add_argument("--run-seconds", type=float, default=None,
                    help="cap on each variant's timed run (default: its share of the budget, "
                         "less 30 s for building)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=None, help="default: the plan's (1000)")
    ap.add_argument("--trace", default=None, help="ShareGPT length trace (CSV)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--kernel-profile", default="mixed_graphs,mixed_graphs_unmerged",
                    help="variants whose steps are profiled by kernel kind after their run "
                         "(experiments/kernel_breakdown.py; '' for none)")  # fmt: skip
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    plan = PLANS["smoke" if args.smoke else "full"]
    if args.requests:
        plan = replace(plan, num_requests=args.requests)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    from paged_llm.models import presets
    from paged_llm.models.loader import load_config

    model_dir = save_tiny_llama(out_dir / "tiny-llama") if plan.model == "tiny-llama" else None
    hf_config = load_config(model_dir) if model_dir else presets.preset_config(plan.model)
    work = build_workload(plan.num_requests, hf_config.vocab_size, plan.max_total, args.trace)
    dtype = DTYPE_NAMES.get(plan.dtype) or getattr(torch, plan.dtype)
    copy_bw = 2 * 2**20 * plan.copy_mib / _time_copy(plan.copy_mib * 2**20, device, 3) / 1e9
    doc: dict[str, Any] = {
        "what": "real engine runs (not simulated), one process, variants in order",
        "device": device_name(device),
        "model": plan.model,
        "dtype": str(dtype),
        "workload": {
            "source": work.source,
            "requests": len(work.prompts),
            "output_tokens": work.output_tokens,
        },  # fmt: skip
        "copy_bandwidth_GBps": copy_bw,
        "variants": {},
    }
    out_path = out_dir / "gpu_e2e_variants.json"
    mean_in = sum(map(len, work.prompts)) / len(work.prompts)
    context = mean_in + statistics.mean(work.output_lens) / 2
    profiled = set(filter(None, args.kernel_profile.split(",")))
    profile_args = {
        "context": round(context),
        "vocab_size": hf_config.vocab_size,
        "bytes_per_step": bound_bytes(hf_config, dtype),
        "copy_GBps": copy_bw,
    }
    first_outputs = None
    for i, name in enumerate(names):
        left = args.budget - (time.perf_counter() - start)
        # ~30 s to build; a kernel profile after the run ~15 s more
        share = max(1.0, left / (len(names) - i) - 30 - 15 * (name in profiled))
        run_s = min(share, args.run_seconds) if args.run_seconds else share
        try:
            record, outputs = run_variant(name, plan, device, str(model_dir or plan.model),
                                          work, run_s,
                                          profile_args if name in profiled else None)  # fmt: skip
        except Exception as err:  # the next variant still runs
            import traceback

            doc["variants"][name] = {"error": f"{type(err).__name__}: {err}",
                                     "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
            _free(device)
            continue
        batch = record["mean_running_batch"] or 1.0
        bound = bandwidth_bound(hf_config, dtype, copy_bw, batch, context)
        record["bandwidth_bound_tokens_per_s"] = bound
        record["fraction_of_bound"] = record["output_tokens_per_s"] / bound
        if first_outputs is None:
            first_outputs = outputs
        else:
            both = [(a, b) for a, b in zip(first_outputs, outputs) if a and b]
            record["same_tokens_as_first"] = (
                sum(a == b for a, b in both) / len(both) if both else None
            )
        doc["variants"][name] = record
        doc["elapsed_s"] = time.perf_counter() - start
        out_path.write_text(json.dumps(doc, indent=1, default=json_default))
    doc["elapsed_s"] = time.perf_counter() - start
    out_path.write_text(json.dumps(doc, indent=1, default=json_default))
    for name, r in doc["variants"].items():
        if "error" in r:
            print(f"{name}: ERROR {r['error']}")
        else:
            print(f"{name}: {r['output_tokens_per_s']:.0f} tok/s, "
                  f"{r['fraction_of_bound']:.2f} of the bound, host "
                  f"{r['step_phases']['host_ms_per_step']:.2f} ms/step, kinds "
                  f"{ {k: v['steps'] for k, v in r['steps_by_kind'].items()} }")  # fmt: skip
    return doc


if __name__ == "__main__":
    main()
