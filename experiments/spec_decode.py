"""Speculative decoding on the built-in trained pair (issue 6): tokens per target step against
(1 - a^(k+1)) / (1 - a) at the measured acceptance rate a, and wall-clock speedup over the target
alone versus k and batch size. Greedy, code prompts from held-out standard-library source.
Writes ``spec_decode.json`` (and a PNG) into the Hydra run directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from paged_llm import LLM, SamplingParams
from paged_llm.metrics.run_info import run_info
from paged_llm.spec.rejection import expected_tokens_per_step


def model_dir(name: str) -> str:
    """A built-in trained model by name, or a checkpoint directory as given."""
    if Path(name).is_dir():
        return name
    from paged_llm.models.trained import trained_model_dir

    return str(trained_model_dir(name))


def code_prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    """Prompts cut from held-out standard-library source the models were not trained on."""
    from paged_llm.models.trained import corpus_tokens

    ids = [int(t) for t in corpus_tokens("target", "heldout")]
    stride = max(length, len(ids) // (num + 1))
    return [ids[i * stride : i * stride + length] for i in range(num)]


def timed_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Seconds and output tokens for one greedy batch."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def run(cfg: dict, out_dir: Path) -> dict:
    """Sweep method x k x batch size; return and write the results."""
    target, draft = model_dir(cfg["target"]), model_dir(cfg["draft"])
    common = dict(block_size=cfg["block_size"], seed=cfg["seed"], max_model_len=512)
    base = LLM(target, **common)
    pool = code_prompts(base.get_tokenizer(), cfg["num_prompts"], cfg["prompt_len"])
    timed_run(base, pool[:2], 4)  # warm-up
    results: dict = {"baseline": {}, "runs": []}
    for bs in cfg["batch_sizes"]:
        prompts = (pool * (bs // len(pool) + 1))[:bs]
        secs, toks = timed_run(base, prompts, cfg["max_tokens"])
        results["baseline"][str(bs)] = {"seconds": secs, "output_tokens_per_s": toks / secs}
    for method in cfg["methods"]:
        for k in cfg["ks"]:
            spec = {"method": method, "num_speculative_tokens": k}
            if method == "draft_model":
                spec["model"] = draft
            llm = LLM(target, speculative_config=spec, **common)
            timed_run(llm, pool[:2], 4)
            for bs in cfg["batch_sizes"]:
                prompts = (pool * (bs // len(pool) + 1))[:bs]
                llm.llm_engine.spec_stats = type(llm.llm_engine.spec_stats)()
                secs, toks = timed_run(llm, prompts, cfg["max_tokens"])
                stats = llm.llm_engine.spec_stats
                a = stats.conditional_acceptance_rate
                tps = toks / secs
                results["runs"].append({
                    "method": method, "k": k, "batch_size": bs, "seconds": secs,
                    "output_tokens_per_s": tps,
                    "speedup": tps / results["baseline"][str(bs)]["output_tokens_per_s"],
                    "tokens_per_target_step": stats.mean_acceptance_length,
                    "predicted_tokens_per_step": expected_tokens_per_step(a, k),
                    **stats.as_dict(),
                })  # fmt: skip
                r = results["runs"][-1]
                print(f"{method:12s} k={k} batch={bs:3d}: {tps:7.1f} tok/s "
                      f"(x{r['speedup']:.2f}), a={a:.3f}, tokens/step "
                      f"{r['tokens_per_target_step']:.2f} vs formula "
                      f"{r['predicted_tokens_per_step']:.2f}")  # fmt: skip
    results.update(run_info("real"), config=cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec_decode.json").write_text(json.dumps(results, indent=2))
    plot(results, out_dir / "spec_decode.png")
    return results


def plot(results: dict, path: Path) -> None:
    """Speedup vs k per batch size, and measured vs predicted tokens per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    runs = results["runs"]
    for method in sorted({r["method"] for r in runs}):
        for bs in sorted({r["batch_size"] for r in runs}):
            pts = [r for r in runs if r["method"] == method and r["batch_size"] == bs]
            ax1.plot([r["k"] for r in pts], [r["speedup"] for r in pts], "o-",
                     label=f"{method}, batch {bs}")  # fmt: skip
        pts = [r for r in runs if r["method"] == method and r["batch_size"] == 1]
        ax2.plot([r["k"] for r in pts], [r["tokens_per_target_step"] for r in pts], "o-",
                 label=f"{method} measured")  # fmt: skip
        ax2.plot([r["k"] for r in pts], [r["predicted_tokens_per_step"] for r in pts], "x--",
                 label=f"{method} (1-a^(k+1))/(1-a)")  # fmt: skip
    ax1.axhline(1.0, color="gray", lw=0.5)
    ax1.set(xlabel="k (draft tokens)", ylabel="speedup over target alone", title="wall clock")
    ax2.set(xlabel="k", ylabel="tokens per target step", title="batch 1")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    fig.suptitle(f"real run on {results['hardware']['cpu']} ({results['date']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@hydra.main(config_path="../configs", config_name="spec_decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    run(resolved, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
