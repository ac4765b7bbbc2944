"""What detokenization costs the engine: every sequence's text decoded again in full at every
step (what the engine did before ``paged_llm/engine/detokenizer.py``) against incremental
decoding, with no text at all (``detokenize=False``) as the floor, in one process, interleaved,
fastest of ``--repeats``. Checks that both ways give the same texts.

    python -m experiments.detokenize [--model tiny] [--requests 64] [--tokens 1000]
        [--repeats 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

from experiments.common.timing import fastest_interleaved
from paged_llm import LLM, SamplingParams
from paged_llm.metrics.run_info import run_info, write_json

WAYS = ("full decode every step", "incremental", "no text")


def run_once(llm: LLM, way: str, prompts: list[dict], tokens: int) -> tuple[float, list[str]]:
    """Seconds to generate every prompt's ``tokens`` tokens one way; the texts."""
    engine = llm.llm_engine
    facts = engine.text.facts
    if way == "full decode every step":
        engine.text.facts = None  # what every sequence falls back to: decode it all
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            detokenize=way != "no text")  # fmt: skip
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        engine.text.facts = facts
    return seconds, [o.outputs[0].text for o in outs]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; write detokenize.json; return it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="outputs/detokenize")
    args = p.parse_args(argv)
    llm = LLM(args.model, max_model_len=args.tokens + 16, cpu_kv_cache_gib=0.5, seed=0)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(args.requests)]
    runs = {way: partial(run_once, llm, way, prompts, args.tokens) for way in WAYS}
    best, texts = fastest_interleaved(runs, args.repeats)
    floor = best["no text"]
    doc = {
        **run_info("real"),
        "model": args.model,
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "seconds": best,
        "text_cost_s": {w: best[w] - floor for w in WAYS if w != "no text"},
        "same_texts": texts["full decode every step"] == texts["incremental"],
        "notes": "fastest of repeats, ways interleaved in one process; text cost = seconds "
        "minus the no-text run",
    }
    print(f"wrote {write_json(args.out, 'detokenize.json', doc)}")
    return doc


if __name__ == "__main__":
    main()
