"""The engine's host time per decode step, on the CPU: everything a step does outside the
model's forward (issue 39: on the H100 the GPU idled ~4 ms per step while the host scheduled,
built inputs and made outputs).

The real engine (``LLM``, CPU backend) runs a tiny random Llama (2 layers, hidden 64: its
forward is cheap, and the host work does not depend on the model's size) on ``requests``
requests at batch ``requests``, prompts of 300-900 random tokens, greedy, ``ignore_eos``; once
every request decodes, ``steps`` steps are profiled by ``StepPhaseProfile``, ``repeats``
times. Per phase it reports the median over repeats of ms per step; ``host_ms`` sums the phases
a GPU waits through (schedule, plugins, inputs, update, outputs, caller). ``sample`` is apart:
on the CPU it includes the LM head's argmax.

    python -m experiments.bench_host_step [requests=256] [steps=40] [repeats=3]
        [prefix_caching=true] [async_scheduling=true]    # JSON in the Hydra run directory

The peer is the same command on the commit before a change, run in the same minute (its
``git`` field says which). Output kinds: ``cumulative`` (``LLMEngine.step``'s default, as the
GPU check's loop reads it), ``delta`` (a streaming server) and ``final_only`` (``LLM.generate``).
``async_scheduling=true``: the same work, pipelined (on a GPU ``outputs`` and ``caller`` then
overlap the next forward; on the CPU nothing overlaps, so this shows the pipeline's own cost).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments.common.checkpoints import save_tiny_llama
from experiments.common.cli import command, hydra_app, settings
from experiments.common.hardware import host_info
from paged_llm.engine.profile import HOST_PHASES
from paged_llm.metrics.run_info import write_json
from paged_llm.sampling_params import RequestOutputKind, SamplingParams

KINDS = {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA,
         "final_only": RequestOutputKind.FINAL_ONLY}  # fmt: skip
MAX_MODEL_LEN = 2048


def decoding(engine: Any) -> bool:
    """Every request admitted and past its prompt."""
    sched = engine.scheduler
    return not sched.waiting and all(r.num_output_tokens > 0 for r in sched.running)


def measure(model_dir: Path, kind: str, requests: int, steps: int, repeats: int,
            prefix_caching: bool = False, async_scheduling: bool = False) -> dict:  # fmt: skip
    """Median ms per step of each phase over ``repeats`` windows of ``steps`` decode steps."""
    from paged_llm import LLM

    llm = LLM(str(model_dir), dtype="float32", device="cpu", seed=0, max_num_seqs=requests,
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=4096, cpu_kv_cache_gib=1.0,
              enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
              plugins=["paged_llm.engine.profile.StepPhaseProfile"])  # fmt: skip
    engine = llm.llm_engine
    rng = random.Random(0)
    max_tokens = (steps + 2) * repeats + 8  # nobody finishes inside the windows
    params = replace(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                     output_kind=KINDS[kind])  # fmt: skip
    for i in range(requests):
        prompt = [rng.randrange(256) for _ in range(rng.randint(300, 900))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while not decoding(engine):
        engine.step()
    profile = engine.core.plugins[-1]
    windows, host = [], []
    for _ in range(repeats):
        engine.step()  # the profile's caller/outputs phases need a step before
        profile.reset()
        for _ in range(steps):
            engine.step()
        summary = profile.summary()
        windows.append({k: v["ms_per_step"] for k, v in summary["phases"].items()})
        host.append(summary["host_ms_per_step"])
    llm.shutdown()
    phases = {k: statistics.median(w.get(k, 0.0) for w in windows) for k in windows[0]}
    return {
        "host_ms": statistics.median(host),
        "host_ms_windows": host,
        "phases_ms": phases,
        "batch": requests,
    }


def git_commit() -> str | None:
    """The commit measured (with ``+dirty`` for uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Measure each output kind with the config's settings; write bench_host_step.json into
    out_dir; return it."""
    args = settings(cfg)
    kinds = list(args.kinds)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown output kinds {unknown}; choose from {sorted(KINDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_llama(Path(tmp) / "tiny_llama", MAX_MODEL_LEN)
        rows = {k: measure(model_dir, k, args.requests, args.steps, args.repeats,
                           args.prefix_caching, args.async_scheduling) for k in kinds}  # fmt: skip
    doc = {
        "what": "real host-side timings of the engine's decode steps on the CPU (tiny model)",
        "hardware": host_info("cpu"),
        "git": git_commit(),
        "command": command("experiments.bench_host_step"),
        "prefix_caching": args.prefix_caching,
        "async_scheduling": args.async_scheduling,
        "host_phases": list(HOST_PHASES),
        "kinds": rows,
    }
    print(f"wrote {write_json(out_dir, 'bench_host_step.json', doc)}")
    print(json.dumps({k: {"host_ms": round(r["host_ms"], 3),
                          **{p: round(v, 3) for p, v in r["phases_ms"].items()}}
                      for k, r in rows.items()}, indent=1))  # fmt: skip
    return doc


def main() -> None:
    """``python -m experiments.bench_host_step [key=value ...]`` (configs/bench_host_step.yaml)."""
    hydra_app("bench_host_step", write)


if __name__ == "__main__":
    main()
