"""``python -m experiments.gpu``: run the sections in order and write ``gpu_check.json``."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

import experiments.gpu
from experiments.common.hardware import device_info
from experiments.common.timing import Budget, Deadline
from experiments.gpu.bandwidth import section_bandwidth
from experiments.gpu.decode_bandwidth import section_decode_bandwidth
from experiments.gpu.end_to_end import section_end_to_end
from experiments.gpu.fig18a import section_fig18a
from experiments.gpu.kernels import section_kernels
from experiments.gpu.plans import EXTRA_SECTIONS, PLANS, SECTIONS, Plan
from experiments.gpu.report import SCHEMA, Report, run_section
from experiments.gpu.targets import evaluate_targets


def selected_sections(args: argparse.Namespace) -> set[str]:
    """The sections this run does: --only's list, else the core ones (+ the extras)."""
    if args.only:
        chosen = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = chosen - set(SECTIONS) - {"bandwidth"}
        if unknown:
            raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
        return chosen
    return {n for n in SECTIONS if n not in EXTRA_SECTIONS or args.extras}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check; return the JSON document (also written to ``--out``/gpu_check.json)."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.gpu", description=experiments.gpu.__doc__.split("\n")[0]
    )
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
        help="spec_decode's models, from `python -m experiments.gpu.spec_decode --export DIR` "
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
            "command": " ".join(["python -m experiments.gpu", *args.argv]),
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
    from experiments.gpu.memory_features import section_sleep_offload
    from experiments.gpu.parity import section_parity
    from experiments.gpu.spec_decode import section_spec_decode
    from experiments.gpu.sweeps import section_kernel_sweep, section_quant_decode

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
