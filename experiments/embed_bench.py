"""Embedding throughput: the pooling engine (``LLM.embed``) against transformers' own model run
the usual ways, on the same prompts, interleaved in one process, fastest of ``repeats``:

    paged_llm    LLM(runner="pooling").embed: prompts packed into one flat batch per step (no
                 padding), up to max_num_batched_tokens tokens a step
    hf_padded    AutoModel forward on batches of ``batch`` prompts in the given order, padded
                 to each batch's longest prompt (last-token pooling through the mask)
    hf_sorted    the same on length-sorted batches (sentence-transformers' trick: less padding)

The model is a random Qwen3 (the Qwen3-Embedding architecture) of the LoRA benchmark's width,
cached under $PAGED_LLM_CACHE; prompt lengths are log-normal (seeded). Every system's embeddings
are compared with paged_llm's (max abs difference). Writes ``embed_bench.json``.

    python -m experiments.embed_bench [prompts=64] [mean_len=96] [batch=16] [repeats=2]
        [threads=N]    # configs/embed_bench.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from experiments.common.cli import command, hydra_app, settings
from experiments.common.timing import fastest_interleaved, timed
from paged_llm import LLM
from paged_llm.metrics.run_info import run_info, write_json

ARCH = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=8, head_dim=64, vocab_size=6144, max_position_embeddings=2048,
            initializer_range=0.02)  # fmt: skip


def model_dir() -> Path:
    """The benchmark's random Qwen3, written once into the cache."""
    import transformers as tf

    from experiments.common.checkpoints import cached
    from paged_llm.models.presets import cache_root

    def write(tmp: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**ARCH))
        model.save_pretrained(str(tmp))

    return cached(cache_root() / "embed-bench-qwen3-512x6", write)


def prompt_lengths(count: int, mean: int, seed: int) -> list[int]:
    """Log-normal lengths (sigma 0.8) with the given mean, clipped to [4, 1024]."""
    rng = random.Random(seed)
    mu = math.log(mean) - 0.8**2 / 2
    return [min(1024, max(4, round(rng.lognormvariate(mu, 0.8)))) for _ in range(count)]


def padded_tokens(lengths: list[int], batch: int) -> int:
    """Tokens a padded batching computes: each batch's longest prompt times its size."""
    chunks = [lengths[b : b + batch] for b in range(0, len(lengths), batch)]
    return sum(max(c) * len(c) for c in chunks)


@torch.no_grad()
def hf_embed(model: Any, prompts: list[list[int]], batch: int, sort: bool) -> list[torch.Tensor]:
    """Last-token, L2-normalised embeddings from transformers, in prompt order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if sort else None
    order = order or list(range(len(prompts)))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):  # right padding: last real token at len - 1
            ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
            mask[row, : len(prompts[i])] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(idx)), mask.sum(1) - 1]
        for row, i in enumerate(idx):
            out[i] = F.normalize(last[row].float(), dim=-1)
    return out  # type: ignore[return-value]


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write embed_bench.json into out_dir; return it."""
    args = settings(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers as tf

    path = model_dir()
    lengths = prompt_lengths(args.prompts, args.mean_len, seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, ARCH["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
    llm = LLM(str(path), runner="pooling", max_model_len=1024, cpu_kv_cache_gib=0.5,
              max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    hf = tf.AutoModel.from_pretrained(str(path)).eval()

    def ours() -> list[torch.Tensor]:
        outs = llm.embed([{"prompt_token_ids": q} for q in prompts], use_tqdm=False)
        return [torch.tensor(o.outputs.embedding) for o in outs]

    systems = {
        "paged_llm": ours,
        "hf_padded": lambda: hf_embed(hf, prompts, args.batch, sort=False),
        "hf_sorted": lambda: hf_embed(hf, prompts, args.batch, sort=True),
    }
    for fn in systems.values():  # warm-up: first-call allocations
        fn()
    runs = {name: timed(fn) for name, fn in systems.items()}
    best, vectors = fastest_interleaved(runs, args.repeats)
    tokens = sum(lengths)
    padded = {"hf_padded": padded_tokens(lengths, args.batch),
              "hf_sorted": padded_tokens(sorted(lengths), args.batch)}  # fmt: skip
    padded["paged_llm"] = tokens
    doc = {
        **run_info("real"),
        "command": command("experiments.embed_bench"),
        "model": {"arch": ARCH, "type": "Qwen3ForCausalLM, random weights"},
        "settings": vars(args),
        "prompt_tokens": tokens,
        "systems": {
            name: {
                "seconds": s,
                "prompt_tokens_per_s": tokens / s,
                "computed_tokens": padded[name],
                "relative_to_hf_padded": best["hf_padded"] / s,
                "max_abs_diff_vs_paged_llm": max(
                    float((a - b).abs().max()) for a, b in zip(vectors[name], vectors["paged_llm"])
                ),
            }
            for name, s in best.items()
        },
        "notes": "fastest of repeats, systems interleaved in one process; computed_tokens counts "
        "padding; relative_to_hf_padded = hf_padded seconds / system seconds.",
    }
    print(json.dumps(doc["systems"], indent=2))
    print(f"wrote {write_json(out_dir, 'embed_bench.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.embed_bench [key=value ...]`` (configs/embed_bench.yaml)."""
    hydra_app("embed_bench", write)


if __name__ == "__main__":
    main()
