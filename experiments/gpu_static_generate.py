"""Static-batch ``generate`` measured on whole batches (issue 9's >= 10x comparison), with a
profile of its decode steps: the check's end-to-end section only probes it when its time box
cannot hold a batch (a batch of 32 ShareGPT requests decodes to its longest output).

Same model shape, dtype, workload (lengths, seed, prompt ids) and batch size as the GPU check's
end-to-end section (experiments/gpu/end_to_end.py), so its tokens/s compares with that
section's engine run.

    python -m experiments.gpu_static_generate --trace T --out DIR [--seconds 200]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.hardware import device_info
from experiments.common.timing import Deadline
from experiments.common.workloads import build_workload
from experiments.gpu.end_to_end import run_hf_static
from experiments.gpu.plans import FULL, PLANS


def profile_generate(model: Any, prompts: list[list[int]], steps: int) -> str:
    """torch.profiler table (by CUDA time) of one ``generate`` call of ``steps`` new tokens."""
    from torch.profiler import ProfilerActivity, profile

    from experiments.common.hf_baselines import generate_static_batch

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        generate_static_batch(model, prompts, [steps] * len(prompts))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return "\n\n".join(
        prof.key_averages().table(sort_by=k, row_limit=25) for k in (key, "self_cpu_time_total")
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run whole static batches until the time is up; write JSON and the profile."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", help="CSV of input_len,output_len (as the GPU check)")
    parser.add_argument("--out", default="outputs/gpu_static_generate")
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (for tests)")
    args = parser.parse_args(argv)
    plan = PLANS["smoke"] if args.smoke else FULL
    device = torch.device("cpu" if args.smoke else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM

    from paged_llm.models import presets

    config = presets.preset_config("llama-7b" if not args.smoke else "tiny")
    start = time.perf_counter()
    work = build_workload(plan.num_requests, config.vocab_size, plan.max_total, args.trace)
    dtype = getattr(torch, plan.dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    first = work.prompts[: plan.hf_batch_size]
    (out / "generate_profile.txt").write_text(profile_generate(model, first, 8))
    result = run_hf_static(model, work, plan.hf_batch_size, Deadline.after(args.seconds))
    result.pop("outputs", None)
    doc = {
        "mode": "real",  # transformers' generate really ran; "measured" says whether on a GPU
        "measured": device.type == "cuda",
        "command": "python -m experiments.gpu_static_generate " + " ".join(argv or []),
        "device": device_info(device),
        "model": "llama-7b" if not args.smoke else "tiny",
        "dtype": plan.dtype,
        "workload": {"source": work.source, "requests": len(work.prompts)},
        "attn_implementation": str(getattr(model.config, "_attn_implementation", "unknown")),
        "hf_generate": result,
        "elapsed_s": time.perf_counter() - start,
    }
    (out / "static_generate.json").write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "probe"}, default=str), flush=True)
    return doc


if __name__ == "__main__":
    main()
