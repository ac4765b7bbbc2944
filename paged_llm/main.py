"""The main job (``make run``): generate with the configured model and report what the engine
did (sample completions, throughput, batch sizes and KV use), then run quick simulated
versions of the paper's memory-waste and throughput figures. ``python -m paged_llm.main
model=... policy=... attention=...`` swaps any part. The default model is the small trained
code model ``code-small`` (configs/model/code_small.yaml), built on first use in about a minute;
``model=tiny`` and the other presets have random weights."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from paged_llm.config import engine_config_from_dict
from paged_llm.llm import LLM
from paged_llm.metrics.run_info import run_info
from paged_llm.sampling_params import SamplingParams

log = logging.getLogger("paged_llm.main")


def print_samples(samples: list) -> None:
    """Each prompt followed by its completion, as the text reads (token ids without a
    tokenizer)."""
    for i, out in enumerate(samples, 1):
        text = out.outputs[0].text
        if out.prompt is None:  # a shape preset without tokenizer: token-id prompts
            print(f"\n--- sample {i}: prompt token ids {out.prompt_token_ids}\n{text!r}")
            continue
        print(f"\n--- sample {i}: prompt {out.prompt!r} + completion ---")
        print(f"{out.prompt}{text}")
    print("---")


def run(cfg: DictConfig, out_dir: Path) -> dict:
    """Run the job for a composed config; write ``main.json`` into ``out_dir``."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    logger = instantiate(cfg.logger)
    logger.log_config(resolved)
    llm = LLM.from_config(engine_config_from_dict(resolved))  # code-small: built on first use
    engine = llm.llm_engine
    sampling = SamplingParams(**resolved["job"]["sampling"])
    prompts = list(resolved["job"]["prompts"])
    if engine.tokenizer is None:  # shape presets have no tokenizer: use token ids
        prompts = [{"prompt_token_ids": [1 + i, 2 + i, 3 + i]} for i in range(len(prompts))]
    samples = llm.generate(prompts, sampling, use_tqdm=False)
    print_samples(samples)

    # A small offline batch: random prompts, fixed output lengths, all at once.
    rng = random.Random(0)
    n = resolved["job"]["num_throughput_requests"]
    vocab = engine.vocab_size
    reqs = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(4, 64))]}
        for _ in range(n)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(8, 64), ignore_eos=True)
        for _ in range(n)
    ]
    engine.iteration_stats.clear()
    start = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = engine.iteration_stats
    result = {
        **run_info("real", str(engine.device)),
        "model": resolved["model"]["model"],
        "model_path": str(engine.worker.model_dir or resolved["model"]["model"]),
        "policy": engine.scheduler.kv.name,
        "attention_backend": engine.backend.name,
        "kv_cache_tokens": engine.kv_cache_tokens,
        "samples": [{"prompt": o.prompt, "text": o.outputs[0].text} for o in samples],
        "throughput": {
            "requests": n,
            "elapsed_s": elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "requests_per_s": n / elapsed,
            "iterations": len(stats),
            "mean_batched_requests": sum(s.num_running for s in stats) / max(1, len(stats)),
            "peak_kv_usage": max((s.kv_usage for s in stats), default=0.0),
            "preemptions": sum(s.num_preemptions for s in stats),
        },
        "config": resolved,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "main.json"
    path.write_text(json.dumps(result, indent=2))
    logger.log({k: v for k, v in result["throughput"].items()})
    logger.log_file(path)
    logger.finish()
    t = result["throughput"]
    print(
        f"\n{n} requests: {t['output_tokens_per_s']:.1f} output tokens/s, "
        f"{t['mean_batched_requests']:.1f} requests per batch on average, "
        f"peak KV use {100 * t['peak_kv_usage']:.1f}% ({result['mode']} run on "
        f"{result['hardware']['cpu']}, device {result['hardware']['device']})"
    )
    print(f"results: {path}")
    if resolved["job"].get("paper_figures"):
        from paper_repro.quick import run_quick

        print("\nquick paper figures (simulated OPT-13B on an A100-40GB; see paper_repro/):")
        files = run_quick(out_dir / "paper_repro")
        result["paper_figures"] = [str(f) for f in files]
        for f in files:
            if f.suffix == ".png":
                print(f"  figure: {f}")
        path.write_text(json.dumps(result, indent=2))
    return result


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
