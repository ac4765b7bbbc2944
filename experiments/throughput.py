"""Offline throughput benchmark in the style of vLLM's ``benchmark_throughput``.

    python -m experiments.throughput [overrides]
    python -m experiments.throughput workload.path=paged_llm/workloads/data/sharegpt_opt_lengths.csv

The same requests (random prompt token ids, lengths from a trace or a synthetic fit) run
through this project's paged engine and through transformers (static-batch ``generate`` and
continuous batching), all greedy with EOS disabled, from the same checkpoint. Writes
``throughput.json`` into the Hydra run directory and prints a table.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.bench_model import hf_config, resolve_model_dir
from experiments.common import hf_baselines
from experiments.common.cli import CONFIG_DIR
from experiments.common.hardware import host_info
from experiments.common.timing import Timer
from experiments.common.workloads import Workload, length_pairs, random_prompt_workload
from paged_llm.config_groups import preflight, quant_spec, speculative_spec
from paged_llm.workloads import lengths as wl

logger = logging.getLogger(__name__)

ENGINE = "paged_llm"
SYNTHETIC = {"sharegpt": wl.SHAREGPT}
TIMING_NOTE = (
    "each system: one untimed warm-up on the first requests, then `repeats` timed runs, "
    "interleaved across systems; rates use the fastest run. Model loading and engine/manager "
    "set-up are not timed. cpu_s is the process CPU time (all threads) of that run."
)


# ---- workload ---------------------------------------------------------------------------------
def build_workload(cfg: DictConfig, num_requests: int, vocab_size: int, seed: int) -> Workload:
    """The ``workload`` group's requests: lengths from its trace or synthetic fit, scaled to
    ``max_total``, random prompt token ids (all from ``seed``)."""
    if not cfg.path and cfg.synthetic not in SYNTHETIC:
        raise ValueError(f"unknown synthetic workload '{cfg.synthetic}'; one of {list(SYNTHETIC)}")
    trace = hydra.utils.to_absolute_path(str(cfg.path)) if cfg.path else None
    pairs, source = length_pairs(
        num_requests, seed, trace, cfg.filter_total_below, SYNTHETIC.get(cfg.synthetic, wl.SHAREGPT)
    )
    return random_prompt_workload(pairs, source, vocab_size, cfg.max_total, seed)


# ---- systems ----------------------------------------------------------------------------------
def make_engine(model_dir: Path, cfg: DictConfig) -> Any:
    """The paged engine (``paged_llm.LLM``) over model_dir with the benchmark's settings."""
    from paged_llm import LLM

    e = OmegaConf.to_container(cfg.engine, resolve=True)
    e["quantization"] = quant_spec(e.get("quantization"))
    e["speculative_config"] = speculative_spec(e.get("speculative_config"))
    return LLM(model=str(model_dir), dtype=cfg.dtype, device=cfg.engine_device, seed=cfg.seed, **e)


def run_engine(llm: Any, work: Workload) -> hf_baselines.SystemRun:
    """Greedy, EOS-ignoring generation of every request through the paged engine."""
    from paged_llm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    with Timer() as timer:
        outs = llm.generate(prompts, params, use_tqdm=False)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    notes = ["greedy, ignore_eos, max_tokens = output_len; all requests queued at once"]
    return hf_baselines.SystemRun(timer.wall_s, timer.cpu_s, outputs, work.output_tokens, notes, {})


def run_generate(model: Any, work: Workload, cfg: DictConfig) -> hf_baselines.SystemRun:
    """Static-batch ``generate`` over the workload."""
    return hf_baselines.run_static_generate(
        model, work.prompts, work.output_lens, cfg.generate.batch_size
    )


def run_generate_batch(model: Any, work: Workload, cfg: DictConfig) -> hf_baselines.SystemRun:
    """transformers continuous batching over the workload."""
    g = cfg.generate_batch
    cb = hf_baselines.cb_config_for(
        work.prompts,
        work.output_lens,
        g.page_size,
        g.max_batch_tokens,
        g.max_requests_per_batch,
        g.num_blocks,
    )
    return hf_baselines.run_continuous_batching(
        model, work.prompts, work.output_lens, cb, g.per_request_max_tokens
    )


BASELINES = {"generate": run_generate, "generate_batch": run_generate_batch}
SystemFn = Callable[[Workload], hf_baselines.SystemRun]


def run_round_robin(
    systems: dict[str, SystemFn], work: Workload, repeats: int
) -> dict[str, list[hf_baselines.SystemRun]]:
    """Run every system ``repeats`` times, interleaved, so that a slow spell of a shared
    machine hits all of them rather than whichever ran during it."""
    runs: dict[str, list[hf_baselines.SystemRun]] = {name: [] for name in systems}
    for rep in range(repeats):
        for name, run in systems.items():
            runs[name].append(run(work))
            logger.info("%s run %d: %.2f s", name, rep + 1, runs[name][-1].elapsed_s)
    return runs


# ---- reporting --------------------------------------------------------------------------------
def throughput(runs: list[hf_baselines.SystemRun], work: Workload) -> dict[str, Any]:
    """Rates of the fastest run (output counts only each request's own output_len tokens)."""
    best = min(runs, key=lambda r: r.elapsed_s)
    return {
        "elapsed_s": best.elapsed_s,
        "cpu_s": best.cpu_s,
        "elapsed_all_s": [r.elapsed_s for r in runs],
        "num_requests": len(work.prompts),
        "input_tokens": work.input_tokens,
        "output_tokens": work.output_tokens,
        "generated_tokens": best.generated_tokens,
        "requests_per_s": len(work.prompts) / best.elapsed_s,
        "output_tokens_per_s": work.output_tokens / best.elapsed_s,
        "total_tokens_per_s": (work.input_tokens + work.output_tokens) / best.elapsed_s,
        "output_tokens_per_cpu_s": work.output_tokens / best.cpu_s,
    }


def speedups(systems: dict[str, dict[str, Any]], key: str) -> dict[str, float]:
    """The engine's rate ``key`` over each baseline's."""
    ours = systems[ENGINE][key]
    return {name: ours / stats[key] for name, stats in systems.items() if name != ENGINE}


def compare_outputs(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How many requests produced identical token ids, and the first that did not."""
    same = [a == b for a, b in zip(reference, other)]
    first = next((i for i, ok in enumerate(same) if not ok), None)
    return {
        "identical_requests": sum(same),
        "num_requests": len(reference),
        "first_mismatch": first,
    }


def command_line(overrides: list[str]) -> str:
    """The command that reproduces this run."""
    return shlex.join(["python", "-m", "experiments.throughput", *overrides])


def format_table(systems: dict[str, dict[str, Any]], speedups: dict[str, float]) -> str:
    """A short fixed-width summary table."""
    head = (
        f"{'system':<16}{'elapsed s':>11}{'cpu s':>9}{'req/s':>9}{'out tok/s':>11}"
        f"{'tot tok/s':>11}{'engine x':>10}"
    )
    rows = [head, "-" * len(head)]
    for name, r in systems.items():
        ratio = f"{speedups[name]:.2f}" if name in speedups else "-"
        rows.append(
            f"{name:<16}{r['elapsed_s']:>11.2f}{r['cpu_s']:>9.1f}{r['requests_per_s']:>9.2f}"
            f"{r['output_tokens_per_s']:>11.1f}{r['total_tokens_per_s']:>11.1f}{ratio:>10}"
        )
    return "\n".join(rows)


# ---- main -------------------------------------------------------------------------------------
def check_config(cfg: DictConfig) -> None:
    """Refuse unknown baselines and a quant method the model cannot take, before any work."""
    unknown = set(cfg.baselines) - set(BASELINES)
    if unknown:
        raise ValueError(f"unknown baseline(s) {sorted(unknown)}; choose from {list(BASELINES)}")
    engine = cfg.engine  # the groups, as read through the engine.* keys (their overrides too)
    preflight(
        {"quant": engine.quantization, "speculative": engine.speculative_config},
        hf_config(cfg.model),
    )


def run_benchmark(cfg: DictConfig, out_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """Run every system on one workload; write throughput.json (and outputs.json) to out_dir."""
    check_config(cfg)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)  # one intra-op pool, shared by every system
    dtype = getattr(torch, cfg.dtype)
    model_dir = resolve_model_dir(cfg.model, dtype, cfg.seed)
    hf_model = hf_baselines.load_hf_model(str(model_dir), dtype).to(cfg.engine_device)
    work = build_workload(cfg.workload, cfg.num_requests, hf_model.config.vocab_size, cfg.seed)
    logger.info("workload %s: %d requests, %d input + %d output tokens", work.source,
                len(work.prompts), work.input_tokens, work.output_tokens)  # fmt: skip

    llm = make_engine(model_dir, cfg)
    systems: dict[str, SystemFn] = {ENGINE: lambda w: run_engine(llm, w)}
    for name in cfg.baselines:
        systems[name] = lambda w, fn=BASELINES[name]: fn(hf_model, w, cfg)
    warm = work.head(cfg.warmup_requests, cfg.warmup_max_tokens)
    for run in systems.values():
        run(warm)
    runs = run_round_robin(systems, work, cfg.repeats)

    result = build_result(cfg, overrides, model_dir, hf_model, work, runs)
    outputs = {name: r[0].outputs for name, r in runs.items()}
    write_results(out_dir, result, work, outputs if cfg.save_outputs else None)
    log_run(cfg, result, out_dir)
    print(format_table(result["systems"], result["engine_output_speedup"]))
    print(f"wrote {out_dir / 'throughput.json'}")
    return result


def build_result(
    cfg: DictConfig,
    overrides: list[str],
    model_dir: Path,
    hf_model: Any,
    work: Workload,
    runs: dict[str, list[hf_baselines.SystemRun]],
) -> dict[str, Any]:
    """The throughput.json record: what ran, where, on what, and how fast."""
    stats = {name: throughput(r, work) for name, r in runs.items()}
    outputs = {name: r[0].outputs for name, r in runs.items()}
    settings = {ENGINE: OmegaConf.to_container(cfg.engine, resolve=True)}
    settings |= {n: r[0].settings for n, r in runs.items() if n != ENGINE}
    return {
        "mode": "real",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(overrides),
        "argv": list(sys.argv),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "hardware": host_info(cfg.engine_device),
        "model": {
            "dir": str(model_dir),
            "architecture": hf_model.config.architectures,
            "num_parameters": sum(p.numel() for p in hf_model.parameters()),
            "dtype": cfg.dtype,
        },
        "workload": {
            "source": work.source,
            "num_requests": len(work.prompts),
            "input_tokens": work.input_tokens,
            "output_tokens": work.output_tokens,
            "max_total": cfg.workload.max_total,
        },
        "systems": stats,
        "engine_output_speedup": speedups(stats, "output_tokens_per_s"),
        "engine_output_speedup_cpu": speedups(stats, "output_tokens_per_cpu_s"),
        "output_match": {
            n: compare_outputs(outputs[ENGINE], outputs[n]) for n in runs if n != ENGINE
        },
        "settings": settings,
        "notes": {name: r[0].notes for name, r in runs.items()} | {"timing": [TIMING_NOTE]},
    }


def log_run(cfg: DictConfig, result: dict[str, Any], out_dir: Path) -> None:
    """Send the config, each system's rates and the result file to the configured logger."""
    from hydra.utils import instantiate

    run_logger = instantiate(cfg.logger)
    run_logger.log_config(result["config"])
    metrics = {f"{name}/{k}": v for name, stats in result["systems"].items()
               for k, v in stats.items() if isinstance(v, int | float)}  # fmt: skip
    speedup = {f"speedup/{k}": v for k, v in result["engine_output_speedup"].items()}
    run_logger.log(metrics | speedup)
    run_logger.log_file(out_dir / "throughput.json")
    run_logger.finish()


def write_results(
    out_dir: Path, result: dict[str, Any], work: Workload, outputs: dict[str, Any] | None
) -> None:
    """throughput.json, plus outputs.json (every system's token ids) when outputs are given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    if outputs is not None:
        saved = {"output_lens": work.output_lens, "outputs": outputs}
        (out_dir / "outputs.json").write_text(json.dumps(saved) + "\n")


@hydra.main(config_path=CONFIG_DIR, config_name="throughput", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: run the benchmark into the Hydra run directory."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    if hc.mode.name == "MULTIRUN" and not cfg.sweep_baselines and cfg.baselines:
        logger.info("sweep job: baselines %s skipped (sweep_baselines=false)", list(cfg.baselines))
        cfg.baselines = []
    run_benchmark(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))


if __name__ == "__main__":
    main()
