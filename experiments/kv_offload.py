"""What the prefix cache's CPU tier (``kv_offloading_size``) buys on a multi-turn chat: each
turn's prompt is the conversation so far (earlier prompts and replies) plus a new message, and
turns are served round-robin across conversations, so a small device pool evicts a
conversation's blocks before its next turn. Three engines in one run: no prefix cache, the
device prefix cache alone, and the device cache plus the CPU tier. Reported per engine: prompt
tokens computed vs found in the cache, wall seconds, and whether every reply equals the
no-cache engine's.

    python -m experiments.kv_offload [checkpoint=tiny] [conversations=16] [turns=4] [gpu_blocks=64]
        [offload_gib=0.05]      # configs/kv_offload.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from experiments.common.cli import hydra_app, settings
from paged_llm import LLM, SamplingParams
from paged_llm.metrics.run_info import run_info, write_json

ENGINES = {"no prefix cache": {}, "device prefix cache": {"enable_prefix_caching": True},
           "device + CPU tier": {"enable_prefix_caching": True}}  # fmt: skip


def run_chat(llm: LLM, conversations: int, turns: int, message: int, reply: int, seed: int):
    """Serve every conversation's turns round-robin; (seconds, replies, computed, cached)."""
    rng = random.Random(seed)
    vocab = llm.llm_engine.vocab_size
    history = [[rng.randrange(vocab) for _ in range(2 * message)] for _ in range(conversations)]
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    replies, computed, cached = [], 0, 0
    start = time.perf_counter()
    for turn in range(turns):
        if turn:  # a new user message after the last reply
            for h in history:
                h.extend(rng.randrange(vocab) for _ in range(message))
        outs = llm.generate([{"prompt_token_ids": h} for h in history], params, use_tqdm=False)
        for h, o in zip(history, outs):
            h.extend(o.outputs[0].token_ids)
            replies.append(list(o.outputs[0].token_ids))
            cached += o.num_cached_tokens
            computed += len(o.prompt_token_ids) - o.num_cached_tokens
    return time.perf_counter() - start, replies, computed, cached


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write kv_offload.json into out_dir; return it."""
    args = settings(cfg)
    common = dict(num_gpu_blocks_override=args.gpu_blocks, max_model_len=args.gpu_blocks * 16,
                  max_num_seqs=args.conversations, seed=args.seed)  # fmt: skip
    results, replies = {}, {}
    for name, extra in ENGINES.items():
        offload = args.offload_gib if name == "device + CPU tier" else 0.0
        llm = LLM(args.checkpoint, kv_offloading_size=offload, **common, **extra)
        chat = (args.conversations, args.turns, args.message, args.reply, args.seed)
        seconds, replies[name], computed, cached = run_chat(llm, *chat)
        kv = llm.llm_engine.scheduler.kv
        results[name] = {
            "seconds": seconds,
            "prompt_tokens_computed": computed,
            "prompt_tokens_cached": cached,
            "offload_blocks": kv.offload.num_blocks if kv.offload else 0,
            "blocks_offloaded": kv.offload.num_saved if kv.offload else 0,
            "blocks_loaded_back": kv.offload.num_loaded if kv.offload else 0,
        }
        print(f"{name:>20}: {seconds:6.2f} s, prompt tokens computed {computed}, cached "
              f"{cached}", flush=True)  # fmt: skip
    base = replies["no prefix cache"]
    for name in ENGINES:
        results[name]["same_replies_as_no_cache"] = replies[name] == base
    doc = {
        **run_info("real"),
        "model": args.checkpoint,
        "settings": vars(args),
        "engines": results,
        "notes": "turns served round-robin across conversations; each prompt is the whole "
        "conversation so far; greedy replies of fixed length; one run per engine",
    }
    print(f"wrote {write_json(out_dir, 'kv_offload.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.kv_offload [key=value ...]`` (configs/kv_offload.yaml)."""
    hydra_app("kv_offload", write)


if __name__ == "__main__":
    main()
