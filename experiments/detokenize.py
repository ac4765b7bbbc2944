"""What detokenization costs the engine: every sequence's text decoded again in full at every
step (what the engine did before ``IncrementalDetokenizer``, now in
``paged_llm/engine/output_processor.py``) against incremental
decoding, with no text at all (``detokenize=False``) as the floor, in one process, interleaved,
fastest of ``repeats``. Checks that both ways give the same texts.

    python -m experiments.detokenize [checkpoint=tiny] [requests=64] [tokens=1000] [repeats=2]

Writes ``detokenize.json`` into the Hydra run directory (configs/detokenize.yaml).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from experiments.common.cli import hydra_app
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


def write(cfg: Mapping[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Run the comparison with the config's settings; write detokenize.json; return it."""
    model, requests, tokens = cfg["checkpoint"], cfg["requests"], cfg["tokens"]
    llm = LLM(model, max_model_len=tokens + 16, cpu_kv_cache_gib=0.5, seed=0)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(requests)]
    runs = {way: partial(run_once, llm, way, prompts, tokens) for way in WAYS}
    best, texts = fastest_interleaved(runs, cfg["repeats"])
    floor = best["no text"]
    doc = {
        **run_info("real"),
        "model": model,
        "requests": requests,
        "tokens_per_request": tokens,
        "seconds": best,
        "text_cost_s": {w: best[w] - floor for w in WAYS if w != "no text"},
        "same_texts": texts["full decode every step"] == texts["incremental"],
        "notes": "fastest of repeats, ways interleaved in one process; text cost = seconds "
        "minus the no-text run",
    }
    print(f"wrote {write_json(out_dir, 'detokenize.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.detokenize [key=value ...]`` (configs/detokenize.yaml)."""
    hydra_app("detokenize", write)


if __name__ == "__main__":
    main()
