"""EAGLE's first draft step inside ``observe`` (k head forwards per cycle) against the same
engine running it in ``propose`` (k + 1), timed in one process, interleaved.

    python -m experiments.eagle_first_step --out docs/results/eagle_first_step-DATE-cpu.json

Each round times both variants on the same batches (held-out code prompts, greedy, the
built-in trained target and EAGLE head), alternating which goes first: wall time, and the
seconds spent in the drafter (``observe`` + ``propose``), which is what the change touches,
each also as this process's CPU time (``time.process_time``), which a busy neighbour on a
shared VM disturbs less than wall time. The JSON holds every round and
the median of the paired ratios. The unfused variant is the same drafter with
``_drafts_next`` returning False, i.e. the code before the change. Outputs must match token
for token (both are exact).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.spec_workload import (
    PhaseClock,
    code_prompts,
    generate_greedy,
    model_dir,
    prompt_batches,
)
from paged_llm import LLM
from paged_llm.metrics.run_info import hardware_info


def drafter_clock(drafter: Any) -> PhaseClock:
    """A clock of the seconds spent in the drafter's ``observe`` and ``propose``."""
    clock = PhaseClock()
    for name in ("observe", "propose"):
        clock.wrap(drafter, name, "drafter")
    return clock


def _timed(
    llm: LLM, clock: PhaseClock, batches: list[list[list[int]]], max_tokens: int
) -> tuple[dict[str, float], list]:
    start, cpu = time.perf_counter(), time.process_time()
    clock.reset()
    outputs = generate_greedy(llm, batches, max_tokens)
    return {
        "wall_s": time.perf_counter() - start, "drafter_s": clock.seconds.get("drafter", 0.0),
        "cpu_s": time.process_time() - cpu, "drafter_cpu_s": clock.cpu_seconds.get("drafter", 0.0),
    }, outputs  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the interleaved comparison; write and return the JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ks", default="3,5")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", default="target", help="built-in model name or directory")
    parser.add_argument("--eagle", default="eagle", help="the target's EAGLE head (name or dir)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, head = model_dir(args.target), model_dir(args.eagle)
    pool = code_prompts(args.target, args.num_prompts, 48)
    cells = []
    for k in [int(x) for x in args.ks.split(",")]:
        spec = {"method": "eagle", "model": head, "num_speculative_tokens": k}
        llm = LLM(target, speculative_config=spec, block_size=16, seed=0)
        drafter = llm.llm_engine.drafter
        fused, clock = drafter._drafts_next, drafter_clock(drafter)
        for batch in [int(x) for x in args.batch_sizes.split(",")]:
            batches = prompt_batches(pool, batch)
            _timed(llm, clock, batches[:1], 8)  # warm-up
            rounds = []
            for r in range(args.rounds):
                times, outputs = {}, {}
                for variant in ("fused", "unfused") if r % 2 == 0 else ("unfused", "fused"):
                    drafter._drafts_next = fused if variant == "fused" else (lambda *a: False)
                    times[variant], outputs[variant] = _timed(llm, clock, batches,
                                                              args.max_tokens)  # fmt: skip
                if outputs["fused"] != outputs["unfused"]:
                    raise SystemExit(f"outputs differ at k={k}, batch {batch}")
                rounds.append(times)
            drafter._drafts_next = fused
            cell: dict[str, Any] = {"k": k, "batch_size": batch, "rounds": rounds}
            for key in ("wall_s", "drafter_s", "cpu_s", "drafter_cpu_s"):  # unfused / fused
                ratios = [t["unfused"][key] / t["fused"][key] for t in rounds]
                cell[f"{key}_unfused_over_fused"] = {
                    "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                }  # fmt: skip
            cell["drafter_share_of_wall_unfused"] = statistics.median(
                t["unfused"]["drafter_s"] / t["unfused"]["wall_s"] for t in rounds
            )
            cells.append(cell)
            medians = {key: round(cell[f"{key}_unfused_over_fused"]["median"], 3)
                       for key in ("wall_s", "drafter_s", "cpu_s", "drafter_cpu_s")}  # fmt: skip
            print(f"k={k} batch={batch}: unfused / fused, median of rounds: {medians}")
    doc = {
        "mode": "real",
        "hardware": {**hardware_info("cpu"), "torch_threads": args.threads},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m experiments.eagle_first_step "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "cells": cells,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
