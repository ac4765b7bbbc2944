"""Quantization quality and cost, as a benchmark writing JSON.

    python -m experiments.quant_eval [overrides]     # see configs/quant_eval.yaml

For the built-in trained model (or any local HF checkpoint with a tokenizer), writes
``quant_eval.json`` into the Hydra run directory mapping each weight method (``none``,
``int8``, ``int4_rtn``, ``int4_gptq``, ``int4_awq``, ``fp8``) to its held-out ``perplexity``,
``weight_bytes`` of the quantized linear layers (float counted at fp16) and their ratio to
fp16, and the time to quantize; plus perplexity with a quantized KV cache, the greedy token
agreement of the quantized engine with the float engine, a CPU microbenchmark of the
quantized linear layer, and provenance (``run_info``).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from paged_llm.metrics.run_info import run_info

logger = logging.getLogger(__name__)


# ---- data ------------------------------------------------------------------------------------
def token_streams(cfg: DictConfig) -> tuple[Path, np.ndarray, np.ndarray]:
    """(model dir, train-split tokens, held-out tokens) for the configured model."""
    from paged_llm.models import trained

    if cfg.model.path:
        model_dir = Path(hydra.utils.to_absolute_path(str(cfg.model.path)))
        return model_dir, *stdlib_streams_for(model_dir)
    name = cfg.model.builtin
    model_dir = trained.trained_model_dir(name)
    return model_dir, trained.corpus_tokens(name, "train"), trained.corpus_tokens(name, "heldout")


def stdlib_streams_for(model_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The stdlib corpus split, tokenized with a checkpoint's own tokenizer."""
    from paged_llm.engine.loading import load_tokenizer
    from paged_llm.recipes.corpus import CorpusSpec, read_texts, split_files

    tok = load_tokenizer(model_dir)
    if tok is None:
        raise ValueError(f"{model_dir} has no tokenizer; perplexity needs one to read text")
    train_files, heldout_files = split_files(CorpusSpec())
    streams = []
    for files, limit in ((train_files, 2_000_000), (heldout_files, None)):
        ids: list[int] = []
        for text in read_texts(files):
            ids.extend(tok(text)["input_ids"])
            if limit and len(ids) > limit:
                break
        streams.append(np.asarray(ids, dtype=np.int64))
    return streams[0], streams[1]


# ---- measurements ----------------------------------------------------------------------------
def evaluate_methods(
    cfg: DictConfig, model: torch.nn.Module, heldout: torch.Tensor, calib: torch.Tensor
) -> dict[str, dict[str, Any]]:
    """Quantize a copy of the float model with each method; perplexity, divergence from the
    float model's predictions, bytes, time."""
    from paged_llm.quant import apply_quantization
    from paged_llm.quant.evaluation import (
        divergence,
        linear_weight_bytes,
        next_token_logprobs,
        perplexity_of,
    )

    methods: dict[str, Any] = {"none": None}
    methods.update(OmegaConf.to_container(cfg.methods, resolve=True))
    results: dict[str, dict[str, Any]] = {}
    reference = next_token_logprobs(model, heldout)
    for name, spec in methods.items():
        start = time.perf_counter()
        q = apply_quantization(copy.deepcopy(model), spec, calibration=calib)
        quantize_s = time.perf_counter() - start
        logprobs = reference if spec is None else next_token_logprobs(q, heldout)
        ppl = perplexity_of(logprobs, heldout)
        sizes = linear_weight_bytes(q)
        results[name] = {
            "perplexity": ppl,
            **divergence(reference, logprobs),
            "weight_bytes": sizes["weight_bytes"],
            "fp16_weight_bytes": sizes["fp16_weight_bytes"],
            "weight_bytes_vs_fp16": sizes["weight_bytes"] / sizes["fp16_weight_bytes"],
            "quantize_seconds": round(quantize_s, 2),
            "config": spec,
        }
        base = results["none"]["perplexity"]
        results[name]["perplexity_change_pct"] = 100 * (ppl / base - 1)
        logger.info("%-10s perplexity %.3f (%+.2f%%), KL %.5f, weights %.3fx fp16, quantized "
                    "in %.1fs", name, ppl, results[name]["perplexity_change_pct"],
                    results[name]["kl_divergence"], results[name]["weight_bytes_vs_fp16"],
                    quantize_s)  # fmt: skip
    return results


def kv_cache_results(
    cfg: DictConfig, model: torch.nn.Module, heldout: torch.Tensor
) -> dict[str, dict[str, Any]]:
    """Perplexity with a quantized KV cache (float weights) and bytes per cached token."""
    from paged_llm.models.loader import kv_cache_shape_info
    from paged_llm.quant.evaluation import perplexity
    from paged_llm.quant.kv_cache import kv_cache_spec

    layers, heads, dim = kv_cache_shape_info(model.config)
    dtype = model.get_input_embeddings().weight.dtype
    fp16_bytes = 2 * layers * heads * kv_cache_spec("auto", torch.float16).bytes_per_vector(dim)
    out = {}
    for name in ["auto", *cfg.kv_cache_dtypes]:
        per_token = 2 * layers * heads * kv_cache_spec(name, dtype).bytes_per_vector(dim)
        out[name] = {
            "perplexity": perplexity(model, heldout, kv_cache_dtype=name),
            "bytes_per_token": per_token,
            "bytes_per_token_vs_fp16": per_token / fp16_bytes,
        }
    return out


def greedy_agreement(cfg: DictConfig, model_dir: Path) -> dict[str, dict[str, Any]]:
    """Token agreement of each configured method's engine with the float engine (greedy)."""
    from paged_llm import LLM, SamplingParams
    from paged_llm.quant.evaluation import token_agreement

    params = SamplingParams(temperature=0, max_tokens=cfg.agreement.max_tokens, ignore_eos=True)
    prompts = list(cfg.agreement.prompts)

    def run(spec: Any) -> list[list[int]]:
        llm = LLM(str(model_dir), dtype=cfg.dtype, quantization=spec, cpu_kv_cache_gib=0.05,
                  seed=cfg.seed)  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = run(None)
    out = {}
    for name in cfg.agreement.methods:
        spec = OmegaConf.to_container(cfg.methods[name], resolve=True)
        ids = run(spec)
        out[name] = {
            "token_agreement": token_agreement(ref, ids),
            "identical_outputs": sum(r == o for r, o in zip(ref, ids)),
            "prompts": len(prompts),
            "max_tokens": cfg.agreement.max_tokens,
        }
    return out


def microbenchmark(cfg: DictConfig) -> list[dict[str, Any]]:
    """CPU time of one call of nn.Linear vs its int8 / int4 (g128) / fp8 replacements (these
    dequantize the weight on every call: the CPU path is for correctness, not speed)."""
    from torch import nn

    from paged_llm.quant.int4 import rtn_quantize
    from paged_llm.quant.layers import Fp8Linear, Int4Linear, Int8Linear
    from paged_llm.recipes.training import torch_threads

    rows_out = []
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch_threads(cfg.microbench.threads), torch.no_grad():
        for rows, k, n in cfg.microbench.shapes:
            lin = nn.Linear(k, n, bias=False)
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
            q, s, z = rtn_quantize(lin.weight, 128)
            layers = {
                "float32": lin,
                "int8": Int8Linear.from_float(lin),
                "int4_g128": Int4Linear.from_quantized(q, s, z, 128),
                "fp8": Fp8Linear.from_float(lin),
            }
            x = torch.randn(rows, k, generator=gen)
            entry: dict[str, Any] = {"rows": rows, "in_features": k, "out_features": n}
            for name, layer in layers.items():
                layer(x)  # warm-up
                times = []
                for _ in range(cfg.microbench.repeats):
                    start = time.perf_counter()
                    layer(x)
                    times.append(time.perf_counter() - start)
                # The minimum is the least disturbed by other processes on a shared machine.
                entry[f"{name}_ms_min"] = 1e3 * min(times)
                entry[f"{name}_ms_median"] = 1e3 * float(np.median(times))
            rows_out.append(entry)
    return rows_out


# ---- entry point -----------------------------------------------------------------------------
def select_method(cfg: DictConfig, choice: str | None) -> str | None:
    """Narrow ``methods`` (and the agreement check) to the ``quant`` group's choice, as one job
    of ``-m quant=...`` does; none keeps every method. Returns the method evaluated, if one."""
    if not choice or choice == "none":
        return None
    with open_dict(cfg):
        cfg.methods = {choice: cfg.quant}
        cfg.agreement.methods = [m for m in cfg.agreement.methods if m == choice]
    return choice


def run_eval(cfg: DictConfig, out_dir: Path, selected: str | None = None) -> dict[str, Any]:
    """Every measurement of the config; writes and returns quant_eval.json's content
    (``selected``: the one method a sweep job evaluated, repeated under that key)."""
    from paged_llm.models.loader import load_model
    from paged_llm.quant.calibration import calibration_windows
    from paged_llm.recipes.training import eval_windows

    torch.manual_seed(cfg.seed)
    model_dir, train_tokens, heldout_tokens = token_streams(cfg)
    model, _ = load_model(model_dir, cfg.dtype, "cpu")
    heldout = eval_windows(heldout_tokens, cfg.perplexity.seq_len, cfg.perplexity.windows)
    calib = calibration_windows(
        train_tokens, cfg.calibration.num_samples, cfg.calibration.seq_len, cfg.seed
    )
    # Top level: each weight method's entry, then the other measurements and provenance.
    result: dict[str, Any] = evaluate_methods(cfg, model, heldout, calib)
    result.update(
        model=str(model_dir),
        heldout_tokens=int(heldout.numel()),
        calibration_tokens=int(calib.numel()),
        kv_cache=kv_cache_results(cfg, model, heldout),
        greedy_agreement=greedy_agreement(cfg, model_dir),
        microbenchmark_cpu=microbenchmark(cfg),
        config=OmegaConf.to_container(cfg, resolve=True),
        **run_info("real", "cpu"),
    )
    if selected:  # what a sweep's table reads, whichever method the job ran
        result["selected"] = {"method": selected, **result[selected]}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quant_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def summary(result: dict[str, Any]) -> str:
    """A small table of the methods for the console."""
    lines = [
        f"{'method':<10} {'perplexity':>10} {'change':>8} {'KL (nats)':>10} {'top-1':>7} "
        f"{'bytes vs fp16':>14}"
    ]
    for name in ["none", *result["config"]["methods"]]:
        r = result[name]
        lines.append(
            f"{name:<10} {r['perplexity']:>10.3f} {r['perplexity_change_pct']:>+7.2f}% "
            f"{r['kl_divergence']:>10.5f} {100 * r['top1_agreement']:>6.2f}% "
            f"{r['weight_bytes_vs_fp16']:>14.3f}"
        )
    for name, r in result["greedy_agreement"].items():
        lines.append(f"greedy agreement {name} vs float: {100 * r['token_agreement']:.1f}%")
    return "\n".join(lines)


@hydra.main(config_path="../configs", config_name="quant_eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    from hydra.core.hydra_config import HydraConfig

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    choice = select_method(cfg, HydraConfig.get().runtime.choices.get("quant"))
    result = run_eval(cfg, out_dir, choice)
    print(summary(result))
    print(f"-> {out_dir / 'quant_eval.json'}")


if __name__ == "__main__":
    main()
