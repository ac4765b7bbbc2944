"""The sampler's top-k / top-p mask: batched ``mask_rows`` against the per-row reference.

Times one step's masking of a batch of logits rows (vocabularies of real models) for flat rows
(a random model: the nucleus spans most of the vocabulary, so rows are sorted whole) and
peaked rows (log-Zipf, like a trained model's: the nucleus fits among the top candidates, so
no row is sorted whole), both ways interleaved in one process, fastest of ``--repeats``; it
also checks that both ways keep the same tokens. A third column times the path that never
waits for the device (``may_wait=False``, async scheduling on a GPU: top-p rows sorted whole
instead of checking whether the candidates held the nucleus), which costs most where a wait
costs least, so ``--device cuda`` is where it matters.

    python -m experiments.sampler_mask [--vocab 32000 128256] [--rows 64] [--device cuda]
        [--out DIR]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from experiments.cpu_attention import time_pass
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.runner.top_k_top_p import NUCLEUS_CANDIDATES, apply_top_k_top_p_min_p, mask_rows

SETTINGS = {"top_p=0.95": (-1, 0.95), "top_k=50": (50, 1.0), "top_k=50,top_p=0.9": (50, 0.9)}


def make_rows(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:  # on the CPU
    """[rows, vocab] logits: 'flat' (standard normal) or 'peaked' (log-Zipf slope 2 + noise)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(rows, vocab, generator=gen)
    log_rank = torch.arange(1, vocab + 1).float().log()
    zipf = torch.stack([-2.0 * log_rank[torch.randperm(vocab, generator=gen)] for _ in range(rows)])
    return zipf + 0.3 * torch.randn(rows, vocab, generator=gen)


def _batched(logits: torch.Tensor, k: int, p: float, may_wait: bool = True) -> Any:
    rows = logits.shape[0]
    return lambda: mask_rows(logits, [k] * rows, [p] * rows, [0.0] * rows, may_wait)


def _per_row(logits: torch.Tensor, k: int, p: float) -> Any:
    return lambda: torch.stack([apply_top_k_top_p_min_p(r, k, p, 0.0) for r in logits])


def _finished(fn: Any, device: torch.device) -> Any:
    """``fn`` timed to its device's end (a GPU runs it after the call returns)."""
    if device.type != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize())[0]


def run(vocabs: list[int], rows: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Time the three ways for every vocabulary, row kind and setting; return the result
    table."""
    dev = torch.device(device)
    results = []
    for vocab in vocabs:
        for kind in ("flat", "peaked"):
            logits = make_rows(kind, rows, vocab).to(dev)
            for name, (k, p) in SETTINGS.items():
                batched = _finished(_batched(logits, k, p), dev)
                no_wait = _finished(_batched(logits, k, p, may_wait=False), dev)
                per_row = _finished(_per_row(logits, k, p), dev)
                masks = [f() == float("-inf") for f in (batched, no_wait, per_row)]
                same = all(torch.equal(m, masks[-1]) for m in masks)
                t_batched, t_per_row = time_pass(batched, repeats), time_pass(per_row, repeats)
                t_no_wait = time_pass(no_wait, repeats)
                kept = float((~masks[0]).sum(-1).float().mean())
                row = {"vocab": vocab, "rows": kind, "setting": name,
                       "batched_ms": 1e3 * t_batched, "no_wait_ms": 1e3 * t_no_wait,
                       "per_row_ms": 1e3 * t_per_row, "speedup": t_per_row / t_batched,
                       "same_tokens": same, "kept_per_row": kept}  # fmt: skip
                results.append(row)
                print(f"vocab {vocab:6d} {kind:6s} {name:18s}: batched {row['batched_ms']:7.1f} "
                      f"ms, no wait {row['no_wait_ms']:7.1f} ms, per row "
                      f"{row['per_row_ms']:7.1f} ms, x{row['speedup']:.1f}, same tokens {same}, "
                      f"{kept:.0f} kept per row")  # fmt: skip
    return {"batch_rows": rows, "repeats": repeats, "nucleus_candidates": NUCLEUS_CANDIDATES,
            "device": str(dev), "threads": torch.get_num_threads(), "results": results,
            **run_info("real", dev.type)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: time, print, write sampler_mask.json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where the rows are masked (cpu, cuda)")
    ap.add_argument("--out", default="outputs/sampler_mask")
    args = ap.parse_args(argv)
    result = run(args.vocab, args.rows, args.repeats, args.device)
    print(f"wrote {write_json(args.out, 'sampler_mask.json', result)}")
    return result


if __name__ == "__main__":
    main()
