"""Where a speculative-decoding cycle spends its time on a GPU: the GPU check's spec-decode
workload (experiments/gpu/spec_decode.py) per method at k = 4, with each engine phase timed.

    python3 -m experiments.gpu_spec_profile --out $OUT    # carrying .gpu_inputs

For the target alone and each drafter it records, in one fresh process:

* ``tokens_per_s``: batch 1 and 16 as the GPU check's section measures them (best of 2), so a
  run here tells whether that section's numbers depend on what ran before it in its process;
* ``phases_ms_per_step``: wall time per engine step by phase, from the engine's
  ``StepPhaseProfile`` plug-in (paged_llm/engine/profile.py): ``schedule``, ``plugins`` (the
  drafter's ``propose``), ``inputs``, ``forward`` (the target's launch), ``sample`` (sampling
  or verification, where the host first waits for the device), ``update``, ``outputs`` (the
  drafter's ``observe``, then the outputs) and ``caller``; ``host_ms_per_step`` sums the host
  phases. (Run 13 used method wrappers that synchronized the device after each call; its
  ``propose`` / ``observe`` / ``sample_or_verify`` keys are not these phases.)
* ``target_forwards``: how the target's forwards ran (``graph`` replays, eager ones);
* ``profile_<method>.txt``: torch.profiler's op tables over a few batch-1 requests.

Also the Python threads alive at the start (another busy thread would take the GIL from
these launch-bound loops).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.hardware import device_name
from experiments.gpu.end_to_end import write_profile_tables
from experiments.gpu.plans import PLANS, Plan
from experiments.gpu.spec_decode import _engine, _free, _models
from experiments.spec_workload import (
    forwards_since,
    generate_greedy,
    prompt_batches,
    timed_run,
)
from paged_llm.engine.profile import StepPhaseProfile

PROFILE = "paged_llm.engine.profile.StepPhaseProfile"
RUNS: tuple[tuple[str | None, int], ...] = ((None, 0), ("ngram", 4), ("draft_model", 4),
                                            ("eagle", 4))  # fmt: skip


def _phases(llm: Any, batches: list, max_tokens: int) -> dict[str, Any]:
    """Per-step phase times of one greedy run, from the engine's StepPhaseProfile plug-in."""
    engine = llm.llm_engine
    profile = next(p for p in engine.core.plugins if isinstance(p, StepPhaseProfile))
    profile.reset()
    kinds = dict(engine.runner.forward_kinds)
    start = time.perf_counter()
    generate_greedy(llm, batches, max_tokens)
    wall = time.perf_counter() - start
    summary = profile.summary()
    steps = summary["steps"]
    ms = {phase: p["ms_per_step"] for phase, p in summary["phases"].items()}
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / max(steps, 1),
            "phases_ms_per_step": ms, "host_ms_per_step": summary["host_ms_per_step"],
            "target_forwards": forwards_since(llm, kinds)}  # fmt: skip


def _profile(llm: Any, prompts: list, max_tokens: int, path: Path, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        generate_greedy(llm, prompt_batches(prompts, 1), max_tokens)
    write_profile_tables(prof, path, cuda)


def run(plan: Plan, device: torch.device, out: Path, models_dir: str | None) -> dict[str, Any]:
    """Speed, phase times and a profile per method; the JSON document."""
    dirs, prompts = _models(plan, models_dir)
    smoke = plan.mode == "smoke"
    max_tokens = 8 if smoke else 64
    batch_sizes = (1,) if smoke else (1, 16)
    repeats = 1 if smoke else 2
    doc: dict[str, Any] = {
        "threads_at_start": [t.name for t in threading.enumerate()],
        "device": device_name(device),
        "dtype": plan.dtype, "num_prompts": len(prompts), "max_tokens": max_tokens, "runs": [],
    }  # fmt: skip
    for method, k in RUNS:
        llm = _engine(dirs, method, k, plan.dtype, device, plugins=[PROFILE])
        timed_run(llm, [prompts[:2]], 4)  # warm-up: kernels compile, graphs capture
        row: dict[str, Any] = {"method": method or "none", "k": k, "tokens_per_s": {}}
        for bs in batch_sizes:
            secs, toks = timed_run(llm, prompt_batches(prompts, bs), max_tokens, repeats)
            row["tokens_per_s"][str(bs)] = toks / secs
        for bs in batch_sizes:
            row[f"batch_{bs}"] = _phases(llm, prompt_batches(prompts, bs), max_tokens)
        profiled = prompts[: 1 if smoke else 4]
        _profile(llm, profiled, max_tokens, out / f"profile_{row['method']}.txt", device)
        _free(llm, device)
        doc["runs"].append(row)
        print(json.dumps(row), flush=True)
        (out / "spec_profile.json").write_text(json.dumps(doc, indent=1))  # kept on a timeout
    doc["ngram_beside_busy_thread"] = _beside_busy_thread(
        dirs, prompts, max_tokens, repeats, plan, device
    )
    return doc


def _beside_busy_thread(dirs, prompts, max_tokens, repeats, plan, device) -> dict[str, float]:
    """n-grams (k = 4) at batch 1 alone and beside a pure-Python busy thread, as a leftover
    thread of an earlier section (say transformers' continuous-batching loop) would be."""
    llm = _engine(dirs, "ngram", 4, plan.dtype, device)
    batches = prompt_batches(prompts, 1)
    timed_run(llm, [prompts[:2]], 4)
    alone, toks = timed_run(llm, batches, max_tokens, repeats)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, name="busy", daemon=True)
    thread.start()
    try:
        beside, _ = timed_run(llm, batches, max_tokens, repeats)
    finally:
        stop.set()
        thread.join()
    _free(llm, device)
    return {"alone_tokens_per_s": toks / alone, "beside_busy_thread_tokens_per_s": toks / beside}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI: write ``spec_profile.json`` and the profile tables into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spec-models", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check, test models")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    plan = PLANS["smoke" if args.smoke else "full"]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    doc = run(plan, device, args.out, args.spec_models)
    doc["elapsed_s"] = time.perf_counter() - start
    (args.out / "spec_profile.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
