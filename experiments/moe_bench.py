"""What a mixture-of-experts layer costs the engine against the two dense models it sits between.
Every system runs the same requests in one process, interleaved, fastest of ``repeats``:

    moe           Mixtral-style: E experts of intermediate size I, top-k routing per token
    dense_active  Llama with intermediate k * I: the MoE's parameters *used* per token
    dense_total   Llama with intermediate E * I: the MoE's parameters *stored*

Same hidden size, layers, heads and vocabulary everywhere (the LoRA benchmark's ~25M-parameter
shape), random weights, greedy with ``ignore_eos``. A batch of B decoding tokens touches about
E * (1 - (1 - k/E)^B) experts, so at small batches the MoE reads little more than
dense_active's weights and at large ones all of dense_total's; its FLOPs stay dense_active's.
The MoE's greedy tokens are also checked against transformers' own Mixtral on a few prompts,
and one feed-forward block of each system is timed alone at several row counts.

    python -m experiments.moe_bench [requests=32] [prompt=64] [tokens=64] [experts=8] [top_k=2]
        [repeats=2] [threads=N]    # configs/moe_bench.yaml; JSON in the Hydra run directory

Writes ``moe_bench.json``.
"""

from __future__ import annotations

import json
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from experiments.common.cli import command, hydra_app, settings
from experiments.common.timing import fastest_interleaved
from paged_llm import LLM, SamplingParams
from paged_llm.metrics.run_info import run_info, write_json

SHAPE = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
             vocab_size=6144, max_position_embeddings=2048, initializer_range=0.02)  # fmt: skip
EXPERT_INTERMEDIATE = 688  # 2 x 688 = 1376, the dense benchmark model's intermediate size


def save_model(kind: str, out: Path, experts: int, top_k: int, seed: int = 0) -> Path:
    """A random transformers checkpoint of one system, written once into ``out``."""
    import transformers as tf

    from experiments.common.checkpoints import cached

    def write(tmp: Path) -> None:
        if kind == "moe":
            moe = dict(num_local_experts=experts, num_experts_per_tok=top_k)
            config = tf.MixtralConfig(**SHAPE, **moe, intermediate_size=EXPERT_INTERMEDIATE)
        else:
            width = (top_k if kind == "dense_active" else experts) * EXPERT_INTERMEDIATE
            config = tf.LlamaConfig(**SHAPE, intermediate_size=width)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = tf.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(str(tmp))

    return cached(out, write)


def parameters_m(model_dir: Path) -> float:
    """Millions of parameters stored in the checkpoint."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors handle is not iterable itself
        return sum(math.prod(f.get_slice(n).get_shape()) for n in names) / 1e6


def run_once(llm: LLM, prompts: list[dict], tokens: int) -> tuple[float, list]:
    """Seconds to generate ``tokens`` tokens for every prompt; the token ids."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


@torch.no_grad()
def transformers_agreement(model_dir: Path, prompts: list[dict], ours: list[list[int]]) -> float:
    """Share of our greedy tokens equal to transformers' ``generate`` on the same prompts."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    same = total = 0
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=len(tokens), **greedy)  # fmt: skip
        ref = out[0, ids.shape[1] :].tolist()
        same += sum(a == b for a, b in zip(ref, tokens))
        total += len(tokens)
    return same / max(1, total)


def layer_times(tokens: int, experts: int, top_k: int, calls: int = 50) -> dict[str, Any]:
    """Milliseconds per feed-forward call for ``tokens`` rows: the MoE layer (routing included)
    against the dense MLPs of dense_active and dense_total (the model's float32 weights)."""
    import torch.nn.functional as F

    from paged_llm.ops.moe import fused_experts, select_experts

    gen = torch.Generator().manual_seed(tokens)
    h, i = SHAPE["hidden_size"], EXPERT_INTERMEDIATE
    x = torch.randn(tokens, h, generator=gen)
    router = torch.randn(experts, h, generator=gen)
    gate_up = torch.randn(experts, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(experts, h, i, generator=gen) / i**0.5

    def moe() -> torch.Tensor:
        weights, ids = select_experts(F.linear(x, router), top_k, renormalize=True)
        return fused_experts(x, gate_up, down, weights, ids)

    def dense(width: int):
        w_gate_up = torch.randn(2 * width, h, generator=gen) / h**0.5
        w_down = torch.randn(h, width, generator=gen) / width**0.5

        def mlp() -> torch.Tensor:
            g, u = F.linear(x, w_gate_up).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, w_down)

        return mlp

    fns = {"moe": moe, "dense_active": dense(top_k * i), "dense_total": dense(experts * i)}
    out: dict[str, Any] = {"tokens": tokens}
    with torch.no_grad():
        for name, fn in fns.items():
            fn()  # warm-up
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out[f"{name}_ms"] = (time.perf_counter() - start) / calls * 1e3
        _, ids = select_experts(F.linear(x, router), top_k, renormalize=True)
    out["experts_hit"] = int(ids.unique().numel())
    return out


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write moe_bench.json into out_dir; return it."""
    args = settings(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    from paged_llm.models.presets import cache_root

    root = cache_root() / "moe-bench"
    tag = f"e{args.experts}k{args.top_k}"
    dirs = {kind: save_model(kind, root / f"{kind}-{tag}", args.experts, args.top_k)
            for kind in ("moe", "dense_active", "dense_total")}  # fmt: skip
    common = dict(max_model_len=args.prompt + args.tokens + 16, cpu_kv_cache_gib=0.5, seed=0)
    systems = {name: LLM(str(path), **common) for name, path in dirs.items()}
    vocab = SHAPE["vocab_size"]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % vocab for j in range(args.prompt)]}
               for i in range(args.requests)]  # fmt: skip
    for llm in systems.values():  # warm-up: first-call allocations
        run_once(llm, prompts[:2], 4)
    runs = {name: partial(run_once, llm, prompts, args.tokens) for name, llm in systems.items()}
    best, tokens = fastest_interleaved(runs, args.repeats)
    checked = prompts[: args.check_prompts]
    agreement = transformers_agreement(dirs["moe"], checked, tokens["moe"][: len(checked)])
    layers = [layer_times(int(t), args.experts, args.top_k) for t in args.layer_tokens]
    output_tokens = args.requests * args.tokens
    doc = {
        **run_info("real"),
        "command": command("experiments.moe_bench"),
        "shape": {**SHAPE, "expert_intermediate_size": EXPERT_INTERMEDIATE},
        "settings": vars(args),
        "systems": {
            name: {
                "parameters_m": round(parameters_m(dirs[name]), 2),
                "seconds": s,
                "output_tokens_per_s": output_tokens / s,
                "relative_to_dense_active": best["dense_active"] / s,
            }
            for name, s in best.items()
        },
        "moe_tokens_equal_transformers": agreement,
        "layer_ms": layers,
        "notes": "fastest of repeats, systems interleaved in one process; "
        "relative_to_dense_active = dense_active seconds / system seconds; "
        "moe_tokens_equal_transformers is the share of the first check_prompts requests' greedy "
        "tokens equal to transformers' MixtralForCausalLM.generate. layer_ms: one feed-forward "
        "block (H x expert_intermediate_size shapes, float32) per call at each row count; "
        "experts_hit: distinct experts the random router picked for those rows.",
    }
    shown = ("systems", "moe_tokens_equal_transformers", "layer_ms")
    print(json.dumps({k: doc[k] for k in shown}, indent=2))
    print(f"wrote {write_json(out_dir, 'moe_bench.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.moe_bench [key=value ...]`` (configs/moe_bench.yaml)."""
    hydra_app("moe_bench", write)


if __name__ == "__main__":
    main()
