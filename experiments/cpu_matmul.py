"""CPU linear layers: torch's default (MKL) against oneDNN's matmul, per input row count.

Times every linear layer of a Llama shape once per pass (weights streamed from memory as in a
real step, not one hot matrix), for each row count and thread count, both paths interleaved in
the same process; the fastest of ``repeats`` passes counts. This is the measurement behind
``cpu_onednn_min_rows`` (``paged_llm/layers/linear_setup.py``).

    python -m experiments.cpu_matmul [shape=throughput|target|draft] [threads=[1,2]]
        # configs/cpu_matmul.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from experiments.common.cli import hydra_app, settings
from paged_llm.layers.linear_setup import onednn_available
from paged_llm.metrics.run_info import run_info, write_json

# (hidden, intermediate, layers, q heads, kv heads, head dim, vocab): experiments/throughput's
# random 25M Llama and the built-in trained target / draft (paged_llm.models.trained)
SHAPES = {
    "throughput": (512, 1376, 6, 8, 8, 64, 6144),
    "target": (384, 1024, 10, 6, 2, 64, 4096),
    "draft": (256, 512, 2, 4, 2, 64, 4096),
}


def layer_weights(shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    """Every linear weight [N, K] of the model, in forward order (q, k, v, o, gate, up, down
    per layer, then the LM head)."""
    hidden, inter, layers, hq, hkv, d, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    dims = [(hq * d, hidden), (hkv * d, hidden), (hkv * d, hidden), (hidden, hq * d),
            (inter, hidden), (inter, hidden), (hidden, inter)]  # fmt: skip
    weights = [torch.randn(n, k, generator=gen) for _ in range(layers) for n, k in dims]
    return weights + [torch.randn(vocab, hidden, generator=gen)]


def mkl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch's default CPU linear (MKL in the official builds)."""
    return F.linear(x, w)


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's matmul, as ``OneDnnLinear`` calls it."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def time_pass(fn: Any, weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Seconds for one pass over every weight with a [rows, K] input (fastest of repeats)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    for w in weights:  # warm-up: oneDNN builds a primitive per shape on first use
        fn(inputs[w.shape[1]], w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return best


def run(shape_name: str, rows: list[int], threads: list[int], repeats: int) -> dict[str, Any]:
    """Time both paths for every (threads, rows); return the result table."""
    weights = layer_weights(SHAPES[shape_name])
    macs_per_row = sum(w.numel() for w in weights)
    results = []
    for n in threads:
        torch.set_num_threads(n)
        for m in rows:
            times = {name: time_pass(fn, weights, m, repeats) for name, fn in
                     (("mkl", mkl), ("onednn", onednn))}  # fmt: skip
            row = {"threads": n, "rows": m, **{f"{k}_ms": 1e3 * t for k, t in times.items()},
                   **{f"{k}_gflops": 2 * macs_per_row * m / t / 1e9 for k, t in times.items()},
                   "onednn_speedup": times["mkl"] / times["onednn"]}  # fmt: skip
            results.append(row)
            print(f"threads {n} rows {m:5d}: mkl {row['mkl_ms']:8.2f} ms "
                  f"({row['mkl_gflops']:5.1f} GFLOP/s)  onednn {row['onednn_ms']:8.2f} ms "
                  f"({row['onednn_gflops']:5.1f})  x{row['onednn_speedup']:.2f}")  # fmt: skip
    return {"shape": shape_name, "weights": len(weights), "params": macs_per_row,
            "repeats": repeats, "results": results, **run_info("real")}  # fmt: skip


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write cpu_matmul.json into out_dir; return it."""
    args = settings(cfg)
    if not onednn_available():
        raise SystemExit("this PyTorch build has no oneDNN; nothing to compare")
    result = run(args.shape, args.rows, args.threads, args.repeats)
    print(f"wrote {write_json(out_dir, 'cpu_matmul.json', result)}")
    return result


def main() -> None:
    """``python -m experiments.cpu_matmul [key=value ...]`` (configs/cpu_matmul.yaml)."""
    hydra_app("cpu_matmul", write)


if __name__ == "__main__":
    main()
