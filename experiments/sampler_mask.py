"""The sampler's top-k / top-p mask: batched ``mask_rows`` against the per-row reference.

Times one step's masking of a batch of logits rows (vocabularies of real models) for flat rows
(a random model: the nucleus spans most of the vocabulary, so rows are sorted whole) and
peaked rows (log-Zipf, like a trained model's: the nucleus fits among the top candidates, so
no row is sorted whole), both ways interleaved in one process, fastest of ``--repeats``; it
also checks that both ways keep the same tokens.

    python -m experiments.sampler_mask [--vocab 32000 128256] [--rows 64] [--out DIR]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from experiments.cpu_attention import time_pass
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.runner.sampler import NUCLEUS_CANDIDATES, apply_top_k_top_p_min_p, mask_rows

SETTINGS = {"top_p=0.95": (-1, 0.95), "top_k=50": (50, 1.0), "top_k=50,top_p=0.9": (50, 0.9)}


def make_rows(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] logits: 'flat' (standard normal) or 'peaked' (log-Zipf slope 2 + noise)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(rows, vocab, generator=gen)
    log_rank = torch.arange(1, vocab + 1).float().log()
    zipf = torch.stack([-2.0 * log_rank[torch.randperm(vocab, generator=gen)] for _ in range(rows)])
    return zipf + 0.3 * torch.randn(rows, vocab, generator=gen)


def _batched(logits: torch.Tensor, k: int, p: float) -> Any:
    rows = logits.shape[0]
    top_k, top_p, min_p = torch.full((rows,), k), torch.full((rows,), p), torch.zeros(rows)
    return lambda: mask_rows(logits, top_k, top_p, min_p)


def _per_row(logits: torch.Tensor, k: int, p: float) -> Any:
    return lambda: torch.stack([apply_top_k_top_p_min_p(r, k, p, 0.0) for r in logits])


def run(vocabs: list[int], rows: int, repeats: int) -> dict[str, Any]:
    """Time both ways for every vocabulary, row kind and setting; return the result table."""
    results = []
    for vocab in vocabs:
        for kind in ("flat", "peaked"):
            logits = make_rows(kind, rows, vocab)
            for name, (k, p) in SETTINGS.items():
                batched = _batched(logits, k, p)
                per_row = _per_row(logits, k, p)
                same = torch.equal(batched() == float("-inf"), per_row() == float("-inf"))
                t_batched, t_per_row = time_pass(batched, repeats), time_pass(per_row, repeats)
                kept = float((batched() > float("-inf")).sum(-1).float().mean())
                row = {"vocab": vocab, "rows": kind, "setting": name,
                       "batched_ms": 1e3 * t_batched, "per_row_ms": 1e3 * t_per_row,
                       "speedup": t_per_row / t_batched, "same_tokens": same,
                       "kept_per_row": kept}  # fmt: skip
                results.append(row)
                print(f"vocab {vocab:6d} {kind:6s} {name:18s}: batched {row['batched_ms']:7.1f} "
                      f"ms, per row {row['per_row_ms']:7.1f} ms, x{row['speedup']:.1f}, "
                      f"same tokens {same}, {kept:.0f} kept per row")  # fmt: skip
    return {"batch_rows": rows, "repeats": repeats, "nucleus_candidates": NUCLEUS_CANDIDATES,
            "threads": torch.get_num_threads(), "results": results, **run_info("real")}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: time, print, write sampler_mask.json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/sampler_mask")
    args = ap.parse_args(argv)
    result = run(args.vocab, args.rows, args.repeats)
    print(f"wrote {write_json(args.out, 'sampler_mask.json', result)}")
    return result


if __name__ == "__main__":
    main()
