"""GPU check section ``spec_decode`` (--extras; see experiments/gpu/): speculative
decoding on the device with the built-in trained target, its draft model, its EAGLE head and
n-grams, whose device paths (the EAGLE head's block-indexed pools, the runner's kept hidden
states, verification batches next to CUDA-graph decodes) ran first on an H200 in run 5
(paper_repro/gpu_results.md).

* ``exactness``: greedy outputs of each method (k = 4) against the target alone on the same
  device, in float32 with TF32 off: the share of identical outputs and of equal tokens. A
  k+1-token verification and a one-token decode go through different kernels, which may round
  a near-tie differently, so this is reported, not required (the CPU tests require identity).
* ``speed``: output tokens/s in the plan's dtype at batch 1 and 16 for the target alone and for
  each method at k = 2 and 4, with the acceptance rate, tokens per target step and how the
  target's forwards ran (``target_forwards``: graph replays and eager ones, both repeats).

The models come from ``--spec-models DIR`` (``target/``, ``draft/``, ``eagle/`` and
``prompts.json``), written on a CPU machine before a loan by
``python -m experiments.gpu.spec_decode --export .gpu_inputs/spec_models`` (the device tool
carries ``.gpu_inputs``); training them on the loan would cost minutes of it. ``--smoke`` uses
the small test models.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.timing import Deadline
from experiments.gpu.plans import Plan

BUILT_IN = {"target": "target", "draft": "draft", "eagle": "eagle"}  # role -> built-in model
ROLES = tuple(BUILT_IN)
SMOKE = {"target": "test-target", "draft": "test-draft", "eagle": "test-eagle"}
DEFAULT_EXPORT = Path(".gpu_inputs/spec_models")
METHODS = ("draft_model", "eagle", "ngram")
DRAFT_ROLE = {"draft_model": "draft", "eagle": "eagle"}  # ngram drafts from the prompt


def export(
    out: Path, names: dict[str, str] = BUILT_IN, num_prompts: int = 16, prompt_len: int = 48
) -> Path:
    """Copy the built-in target, draft and EAGLE head (``names``; trained on first use) to
    ``out`` in bfloat16 (half the bytes the device tool carries), with held-out code prompts."""
    from safetensors.torch import load_file, save_file

    from experiments.spec_workload import code_prompts, model_dir

    for role, name in names.items():
        src, dst = Path(model_dir(name)), out / role
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        for f in src.glob("*.safetensors"):
            tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}
            save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        config = json.loads((dst / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    prompts = code_prompts(names["target"], num_prompts, prompt_len)
    (out / "prompts.json").write_text(json.dumps(prompts))
    return out


def _models(plan: Plan, models_dir: str | None) -> tuple[dict[str, str], list[list[int]]]:
    """Checkpoint directory per role and the code prompts."""
    from experiments.spec_workload import code_prompts, model_dir

    if plan.mode == "smoke":
        dirs = {role: model_dir(name) for role, name in SMOKE.items()}
        return dirs, code_prompts(SMOKE["target"], 4, 16)
    root = Path(models_dir) if models_dir else DEFAULT_EXPORT
    if not (root / "prompts.json").is_file():
        raise FileNotFoundError(
            f"no exported models in {root}: run `python -m experiments.gpu.spec_decode --export "
            f"{DEFAULT_EXPORT}` before the loan and carry .gpu_inputs"
        )
    return {role: str(root / role) for role in ROLES}, json.loads(
        (root / "prompts.json").read_text()
    )


def _engine(
    dirs: dict[str, str], method: str | None, k: int, dtype: str, device: torch.device, **extra
):
    """An LLM on ``device`` running the target alone (method None) or with a drafter; ``extra``
    engine arguments on top (plug-ins, say)."""
    from paged_llm import LLM

    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": k}
        if method in DRAFT_ROLE:
            spec["model"] = dirs[DRAFT_ROLE[method]]
    # 16 sequences of <= 512 tokens need 512 blocks; a fixed pool skips sizing a large one
    return LLM(dirs["target"], dtype=dtype, device=str(device), seed=0, block_size=16,
               max_model_len=512, max_num_seqs=16, num_gpu_blocks_override=1024,
               speculative_config=spec, **extra)  # fmt: skip


def _greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from paged_llm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _free(llm: Any, device: torch.device) -> None:
    llm.shutdown()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _exactness(dirs, prompts, max_tokens, device, deadline: Deadline) -> dict[str, Any]:
    """Greedy outputs of each method (k = 4) against the target alone, in float32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        base = _engine(dirs, None, 0, "float32", device)
        ref = _greedy(base, prompts, max_tokens)
        _free(base, device)
        rows: dict[str, Any] = {}
        for method in METHODS:
            if deadline.left() < 5 and device.type == "cuda":  # the CPU smoke run runs all
                rows[method] = {"skipped": f"{deadline.left():.0f} s left"}
                continue
            llm = _engine(dirs, method, 4, "float32", device)
            got = _greedy(llm, prompts, max_tokens)
            _free(llm, device)
            same = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y))
            rows[method] = {
                "identical_outputs": sum(x == y for x, y in zip(got, ref)) / len(ref),
                "equal_tokens": same / sum(len(y) for y in ref),
            }
        return rows
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _speed(dirs, prompts, max_tokens, dtype, device, deadline: Deadline) -> dict[str, Any]:
    """Output tokens/s of the target alone and each method at k = 2 and 4, batch 1 and 16."""
    from experiments.spec_workload import forwards_since, prompt_batches, timed_run

    batch_sizes = (1, 16) if device.type == "cuda" else (1, 2)
    runs: list[tuple[str | None, int]] = [(None, 0)] + [(m, k) for m in METHODS for k in (2, 4)]
    rows: list[dict[str, Any]] = []
    for method, k in runs:
        if deadline.left() < 5 and device.type == "cuda":
            rows.append({"method": method, "k": k, "skipped": f"{deadline.left():.0f} s left"})
            continue
        llm = _engine(dirs, method, k, dtype, device)
        timed_run(llm, [prompts[:2]], 4)  # warm-up: kernels compile, graphs capture
        for bs in batch_sizes:
            if method is not None:
                llm.llm_engine.spec_stats = type(llm.llm_engine.spec_stats)()
            kinds = dict(llm.llm_engine.runner.forward_kinds)
            secs, toks = timed_run(llm, prompt_batches(prompts, bs), max_tokens, repeats=2)
            row = {"method": method or "none", "k": k, "batch_size": bs, "seconds": secs,
                   "output_tokens_per_s": toks / secs,
                   "target_forwards": forwards_since(llm, kinds)}  # fmt: skip
            if method is not None:
                stats = llm.llm_engine.spec_stats
                row.update(
                    acceptance_rate=stats.conditional_acceptance_rate,
                    tokens_per_target_step=stats.mean_acceptance_length,
                    predicted_tokens_per_step=stats.predicted_tokens_per_step,
                    predicted_tokens_per_step_by_source=stats.predicted_tokens_per_step_by_source,
                )
            rows.append(row)
        _free(llm, device)
    base = {r["batch_size"]: r["output_tokens_per_s"] for r in rows if r.get("method") == "none"}
    for r in rows:
        if r.get("batch_size") in base:
            r["speedup"] = r["output_tokens_per_s"] / base[r["batch_size"]]
    return {"batch_sizes": list(batch_sizes), "rows": rows}


def section_spec_decode(
    plan: Plan, device: torch.device, deadline: Deadline, models_dir: str | None = None
) -> dict[str, Any]:
    """Greedy exactness (float32) and speed (plan dtype) of each drafter on the device."""
    dirs, prompts = _models(plan, models_dir)
    max_tokens = 8 if plan.mode == "smoke" else 64
    start = time.perf_counter()
    # exactness gets at most a third of the section, speed the rest
    exact = _exactness(dirs, prompts, max_tokens, device, Deadline.after(deadline.left() / 3))
    speed = _speed(dirs, prompts, max_tokens, plan.dtype, device, deadline)
    return {
        "models": dirs,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "dtype": plan.dtype,
        "exactness_float32": exact,
        "speed": speed,
        "elapsed_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> None:
    """CLI: ``--export DIR`` writes the models and prompts the section reads on the device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--export", type=Path, default=DEFAULT_EXPORT, help="output directory")
    args = parser.parse_args(argv)
    out = export(args.export)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB); carry .gpu_inputs on the device run")


if __name__ == "__main__":
    main()
