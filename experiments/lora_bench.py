"""What multi-LoRA serving costs the engine, and what batching several adapters together buys.
Every system runs the same requests in one process, interleaved, fastest of ``repeats``:

    base          the model with LoRA off (the peer every other row is divided by)
    lora_unused   enable_lora, but no request names an adapter
    one_adapter   every request on one adapter
    merged        that adapter merged into the weights, LoRA off (a one-adapter deployment)
    mixed         requests round-robin over ``adapters`` adapters, max_loras = that many
    serial        the same requests with max_loras=1: one adapter's requests at a time

    python -m experiments.lora_bench [requests=32] [prompt=64] [tokens=64] [rank=16]
        [adapters=4] [repeats=2] [threads=N]    # configs/lora_bench.yaml; JSON in the run dir

The model is a random ~25M-parameter Llama (the throughput benchmark's shape, cached under
$PAGED_LLM_CACHE); adapters are random PEFT-format checkpoints on all seven projections, written
without PEFT. Greedy, ``ignore_eos``; writes ``lora_bench.json``.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from experiments.common.cli import command, hydra_app, settings
from experiments.common.timing import fastest_interleaved
from paged_llm import LLM, SamplingParams
from paged_llm.lora.request import LoRARequest
from paged_llm.metrics.run_info import run_info, write_json

ARCH = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=6144, max_position_embeddings=2048,
            initializer_range=0.02)  # fmt: skip
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def base_model() -> Path:
    """The benchmark's random Llama, written once into the cache."""
    from experiments.common.checkpoints import cached, save_random_llama
    from paged_llm.models.presets import cache_root

    out = cache_root() / "lora-bench-llama-512x6"
    return cached(out, lambda tmp: save_random_llama(ARCH, tmp, torch.float32, seed=0))


def linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Module name -> (in, out) of every adapted projection, read off the checkpoint."""
    from safetensors import safe_open

    shapes = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors handle is not iterable itself
        for key in names:
            module = key.removesuffix(".weight")
            if key.endswith(".weight") and module.endswith(PROJECTIONS):
                out_f, in_f = f.get_slice(key).get_shape()
                shapes[module] = (in_f, out_f)
    return shapes


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA checkpoint (alpha = 2 x rank) on every projection."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = linear_shapes(model_dir)
    tensors = {}
    for module, (in_f, out_f) in shapes.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
        tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(out_f, rank, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[1] for m in shapes}),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))  # fmt: skip
    return out


def merge_adapter(model_dir: Path, adapter: Path, out: Path) -> Path:
    """A copy of the base checkpoint with W + (alpha / r) B A in every adapted layer."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(model_dir / "model.safetensors"))
    for key, a in lora.items():  # every lora_A names an adapted module; its lora_B pairs it
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            weights[f"{module}.weight"] = weights[f"{module}.weight"] + scaling * (b @ a)
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run_once(llm: LLM, prompts: list[dict], loras: list, tokens: int) -> tuple[float, list]:
    """Seconds to generate ``tokens`` tokens for every prompt; the token ids."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two systems' greedy tokens agree."""
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return same / max(1, sum(len(p) for p in a))


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write lora_bench.json into out_dir; return it."""
    args = settings(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = base_model()
    work = Path(out_dir) / "checkpoints"
    adapters = [
        LoRARequest(f"adapter{i}", i + 1, str(write_adapter(model, work / f"a{i}", args.rank, i)))
        for i in range(args.adapters)
    ]
    merged = merge_adapter(model, Path(adapters[0].lora_path), work / "merged")
    common = dict(max_model_len=args.prompt + args.tokens + 16, cpu_kv_cache_gib=0.5, seed=0)
    lora = dict(enable_lora=True, max_lora_rank=args.rank)
    n = args.requests
    spread = [adapters[i % len(adapters)] for i in range(n)]
    systems: dict[str, tuple[LLM, list]] = {
        "base": (LLM(str(model), **common), [None] * n),
        "lora_unused": (LLM(str(model), **common, **lora), [None] * n),
        "one_adapter": (LLM(str(model), **common, **lora), [adapters[0]] * n),
        "merged": (LLM(str(merged), **common), [None] * n),
        "mixed": (LLM(str(model), **common, **lora, max_loras=len(adapters)), spread),
        "serial": (LLM(str(model), **common, **lora, max_loras=1), spread),
    }
    prompts = [{"prompt_token_ids": [(7 * i + j) % ARCH["vocab_size"] for j in range(args.prompt)]}
               for i in range(n)]  # fmt: skip
    for llm, loras in systems.values():  # warm-up: first-call allocations, adapter loads
        run_once(llm, prompts[:2], loras[:2], 4)
    runs = {name: partial(run_once, llm, prompts, loras, args.tokens)
            for name, (llm, loras) in systems.items()}  # fmt: skip
    best, tokens = fastest_interleaved(runs, args.repeats)
    output_tokens = n * args.tokens
    doc = {
        **run_info("real"),
        "command": command("experiments.lora_bench"),
        "model": {
            "arch": ARCH,
            "parameters_m": round(sum((i * o) for i, o in linear_shapes(model).values()) / 1e6, 2),
        },  # fmt: skip
        "settings": vars(args),
        "systems": {
            name: {
                "seconds": s,
                "output_tokens_per_s": output_tokens / s,
                "relative_to_base": best["base"] / s,
            }  # fmt: skip
            for name, s in best.items()
        },
        "token_agreement": {
            "one_adapter_vs_merged": agreement(tokens["one_adapter"], tokens["merged"]),
            "mixed_vs_serial": agreement(tokens["mixed"], tokens["serial"]),
            "lora_unused_vs_base": agreement(tokens["lora_unused"], tokens["base"]),
        },
        "notes": "fastest of repeats, systems interleaved in one process; relative_to_base = "
        "base seconds / system seconds. parameters_m counts the adapted projections only.",
    }
    print(json.dumps({k: doc[k] for k in ("systems", "token_agreement")}, indent=2))
    print(f"wrote {write_json(out_dir, 'lora_bench.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.lora_bench [key=value ...]`` (configs/lora_bench.yaml)."""
    hydra_app("lora_bench", write)


if __name__ == "__main__":
    main()
