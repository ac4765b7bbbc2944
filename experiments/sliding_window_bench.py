"""What freeing blocks behind a sliding window buys: the same windowed model (a random Mistral,
window W) in the same small KV pool, with and without the paged policy freeing each sequence's
blocks once they fall behind its window, on long generations, interleaved in one process,
fastest of ``repeats``:

    free_behind_window   the engine as built: a decoding sequence holds ~W tokens of KV
    keep_all_blocks      the same engine with its policy's window unset: every block is kept
                         until the request ends, as with full attention

Both compute the same attention (the window is the model's), so their tokens must be identical;
the difference is how many sequences the pool holds at once, hence the batch size and the
throughput. Writes ``sliding_window_bench.json``.

    python -m experiments.sliding_window_bench [requests=24] [prompt_len=64] [output_len=448]
        [window=128] [num_blocks=64] [block_size=16] [repeats=2] [threads=N]
        # configs/sliding_window_bench.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.cli import command, hydra_app, settings
from experiments.common.timing import fastest_interleaved
from paged_llm import LLM, SamplingParams
from paged_llm.core.kv.paged import PagedKVCacheManager, live_blocks
from paged_llm.metrics.run_info import run_info, write_json

ARCH = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
            initializer_range=0.02)  # fmt: skip


def model_dir(window: int) -> Path:
    """The benchmark's random Mistral with a ``window``-token sliding window, cached."""
    import transformers as tf

    from experiments.common.checkpoints import cached
    from paged_llm.models.presets import cache_root

    def write(tmp: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = tf.MistralForCausalLM(tf.MistralConfig(**ARCH, sliding_window=window))
        model.save_pretrained(str(tmp))

    return cached(cache_root() / f"sliding-window-bench-mistral-256x4-w{window}", write)


class KeepEveryBlock(PagedKVCacheManager):
    """The paged policy without freeing behind the window: every block stays until the request
    ends (the peer of the same engine that frees them; the model still attends in its window)."""

    def __init__(self, *args: Any, sliding_window: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, dict]:
    """Drive the engine step by step over all requests; (seconds, outputs and batch stats)."""
    engine = llm.llm_engine
    kv = engine.scheduler.kv
    preempted_before = engine.scheduler.num_preemptions_total
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[int]] = {}
    running, blocks_per_decoding_seq = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        running.append(len(engine.scheduler.running))
        blocks_per_decoding_seq += [
            len(live_blocks(kv.get_block_table(r)))
            for r in engine.scheduler.running
            if r.num_output_tokens
        ]
    seconds = time.perf_counter() - start
    return seconds, {
        "tokens": [outputs[str(i)] for i in range(len(prompts))],
        "steps": len(running),
        "mean_running_seqs": sum(running) / max(1, len(running)),
        "max_running_seqs": max(running, default=0),
        "max_blocks_per_decoding_seq": max(blocks_per_decoding_seq, default=0),
        "preemptions": engine.scheduler.num_preemptions_total - preempted_before,
    }


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write sliding_window_bench.json into out_dir."""
    args = settings(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_dir(args.window)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, ARCH["vocab_size"], (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.requests)
    ]
    engine_args = dict(block_size=args.block_size, num_gpu_blocks_override=args.num_blocks,
                       max_model_len=args.prompt_len + args.output_len,
                       max_num_seqs=args.requests)  # fmt: skip
    freeing = LLM(str(path), **engine_args)
    keeping = LLM(str(path), policy="experiments.sliding_window_bench.KeepEveryBlock",
                  **engine_args)  # fmt: skip
    assert freeing.llm_engine.scheduler.kv.sliding_window == args.window
    assert keeping.llm_engine.scheduler.kv.sliding_window is None  # it keeps every block
    systems = {
        "free_behind_window": lambda: run_engine(freeing, prompts, args.output_len),
        "keep_all_blocks": lambda: run_engine(keeping, prompts, args.output_len),
    }
    best, runs = fastest_interleaved(systems, args.repeats)
    tokens = args.requests * args.output_len
    identical = runs["free_behind_window"]["tokens"] == runs["keep_all_blocks"]["tokens"]
    doc = {
        **run_info("real"),
        "command": command("experiments.sliding_window_bench"),
        "model": {
            "arch": ARCH,
            "sliding_window": args.window,
            "type": "MistralForCausalLM, random weights",
        },  # fmt: skip
        "settings": vars(args),
        "pool_tokens": args.num_blocks * args.block_size,
        "identical_tokens": identical,
        "systems": {
            name: {
                "seconds": s,
                "output_tokens_per_s": tokens / s,
                "speedup_over_keep_all_blocks": best["keep_all_blocks"] / s,
                **{k: v for k, v in runs[name].items() if k != "tokens"},
            }
            for name, s in best.items()
        },
        "notes": "fastest of repeats, systems interleaved in one process; both engines run the "
        "same model and pool; keep_all_blocks is the same engine with the paged policy "
        "given no sliding window (KeepEveryBlock), so it holds every block until the request ends.",
    }
    print(json.dumps(doc["systems"], indent=2))
    print(f"wrote {write_json(out_dir, 'sliding_window_bench.json', doc)}")
    if not identical:
        raise SystemExit("the two engines generated different tokens")
    return doc


def main() -> None:
    """``python -m experiments.sliding_window_bench [key=value ...]`` (its config in configs/)."""
    hydra_app("sliding_window_bench", write)


if __name__ == "__main__":
    main()
