"""The n-gram drafter's match scan (``paged_llm/spec/ngram.py``): the Python loop against the
numpy scan, per context length, on random token ids where nothing matches (the whole context is
scanned, as for a sequence the drafter has nothing to offer) and on a small vocabulary where
matches are near. Both run interleaved in one process; the fastest of ``repeats`` counts.
The crossover sets ``VECTORISE_FROM``.

    python -m experiments.ngram_scan [lengths=[64,256,384,1024,2048,4096]] [calls=50] [repeats=3]

Writes ``ngram_scan.json`` into the Hydra run directory (configs/ngram_scan.yaml).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common.cli import hydra_app
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.spec.ngram import VECTORISE_FROM, scan_numpy, scan_python

VOCABULARIES = {"no_match": 1 << 20, "vocab_16": 16}


# each path as the drafter runs it for one proposal: (what it scans, made from the token list)
PATHS = {"python": (scan_python, lambda tokens: tokens), "numpy": (scan_numpy, np.asarray)}


def time_scan(path: str, tokens: list[int], max_n: int, calls: int) -> float:
    """Seconds per proposal: the scans of n = max_n .. 1 until one matches, as the drafter does
    (the numpy path converts the list once per proposal)."""
    scan, prepare = PATHS[path]
    start = time.perf_counter()
    for _ in range(calls):
        seq = prepare(tokens)
        for n in range(max_n, 0, -1):
            if scan(seq, n) is not None:
                break
    return (time.perf_counter() - start) / calls


def run(lengths: list[int], max_n: int, calls: int, repeats: int, seed: int) -> dict[str, Any]:
    """Time both scans at every length and vocabulary; check they agree."""
    rng = random.Random(seed)
    rows = []
    for name, vocab in VOCABULARIES.items():
        for length in lengths:
            tokens = [rng.randrange(vocab) for _ in range(length)]
            for n in range(1, max_n + 1):
                assert scan_python(tokens, n) == scan_numpy(np.asarray(tokens), n), (length, n)
            best = dict.fromkeys(PATHS, float("inf"))
            for _ in range(repeats):
                for path in PATHS:
                    best[path] = min(best[path], time_scan(path, tokens, max_n, calls))
            rows.append({
                "tokens": name, "context": length,
                "python_us": best["python"] * 1e6, "numpy_us": best["numpy"] * 1e6,
                "python_over_numpy": best["python"] / best["numpy"],
            })  # fmt: skip
            print(f"{name:9s} {length:5d}  python {best['python'] * 1e6:8.1f} us  "
                  f"numpy {best['numpy'] * 1e6:8.1f} us", flush=True)  # fmt: skip
    return {"run_info": run_info("real"), "max_n": max_n, "vectorise_from": VECTORISE_FROM,
            "rows": rows}  # fmt: skip


def write(cfg: Mapping[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Time the scans with the config's settings; write ``ngram_scan.json`` into out_dir."""
    doc = run(list(cfg["lengths"]), cfg["max_n"], cfg["calls"], cfg["repeats"], cfg["seed"])
    print(f"wrote {write_json(out_dir, 'ngram_scan.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.ngram_scan [key=value ...]`` (configs/ngram_scan.yaml)."""
    hydra_app("ngram_scan", write)


if __name__ == "__main__":
    main()
