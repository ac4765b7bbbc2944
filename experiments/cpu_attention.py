"""CPU decode attention: the native kernel (``cpu`` backend) against the torch backend's
gather + bmm path, per batch size and context length, with a streaming read of the same bytes
as the bandwidth peer.

One pass calls each path once per layer, every layer with its own K/V pool and shuffled block
tables, so K/V stream from memory as in a real step rather than staying in cache. Both paths
run interleaved in the same process, check that they agree, and the fastest of ``repeats``
passes counts. This is the measurement behind the ``cpu`` attention backend
(``paged_llm/ops/paged_attention/cpu_decode.cpp``).

With ``query_len``, each sequence instead has that many query tokens (a speculative
verification's k + 1, a short chunk), and the ``cpu`` backend's forward, here made to run them
all as kernel rows (one per token), is timed against the torch backend's gather + SDPA
forward: the data behind the backend's choice between the two (``as_rows``).

    python -m experiments.cpu_attention [shape=throughput|target] [batch=[1,8,64]]
        [context=[64,256,1024]] [threads=[1,2]] [query_len=[2,5,16,32]]
        # configs/cpu_attention.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.cli import hydra_app, settings
from paged_llm.attention.cpu_backend import CpuAttentionBackend
from paged_llm.attention.metadata import build_attention_metadata
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.ops.paged_attention import cpu_native

# (layers, q heads, kv heads, head dim): experiments/throughput's random 25M Llama and the
# built-in trained target (paged_llm.models.trained)
SHAPES = {"throughput": (6, 8, 8, 64), "target": (10, 6, 2, 64)}


def make_layers(
    shape: tuple[int, ...], batch: int, context: int, block_size: int, seed: int = 0,
    query_len: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:  # fmt: skip
    """Per layer: (K pool, V pool, metadata) for ``batch`` sequences of ``context`` tokens,
    the last ``query_len`` of them queries, their blocks shuffled through a pool with a few
    spare blocks."""
    layers, _, hkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 4
    out = []
    for _ in range(layers):
        k = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
        v = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        meta = build_attention_metadata([query_len] * batch, [context] * batch, tables, block_size)
        out.append((k, v, meta))
    return out


def time_pass(fn: Any, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn``."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_config(
    shape: tuple[int, ...], batch: int, context: int, block_size: int, repeats: int
) -> dict[str, Any]:
    """Time both paths and the read peer for one (batch, context); check they agree."""
    _, hq, hkv, d = shape
    layers = make_layers(shape, batch, context, block_size)
    query = torch.randn(batch, hq, d, generator=torch.Generator().manual_seed(1))
    scale = d**-0.5
    torch_backend = TorchAttentionBackend()
    out_native, out_torch = torch.empty_like(query), torch.empty_like(query)

    def native() -> None:
        for k, v, meta in layers:
            cpu_native.paged_decode_cpu(
                out_native, query, k, v, meta.block_tables, meta.seq_lens, scale
            )

    def gather_bmm() -> None:
        for k, v, meta in layers:
            torch_backend._decodes(query, k, v, meta, scale, out_torch, None, None)

    # The peer: one streaming pass over as many bytes as the paths' K/V reads (the whole
    # pools, which exceed the contexts by four spare blocks per layer).
    pools = [t for k, v, _ in layers for t in (k, v)]

    def read() -> None:
        for t in pools:
            t.sum()

    times = {"native": time_pass(native, repeats), "torch": time_pass(gather_bmm, repeats),
             "read": time_pass(read, repeats)}  # fmt: skip
    kv_bytes = len(layers) * 2 * batch * context * hkv * d * 4
    return {
        "batch": batch, "context": context,
        **{f"{k}_ms": 1e3 * t for k, t in times.items()},
        **{f"{k}_gbps": kv_bytes / t / 1e9 for k, t in times.items()},
        "native_speedup": times["torch"] / times["native"],
        "max_abs_diff": float((out_native - out_torch).abs().max()),
    }  # fmt: skip


def run_query_len_config(
    shape: tuple[int, ...], batch: int, context: int, query_len: int, block_size: int,
    repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """Time the cpu backend's kernel rows against the torch backend's SDPA for ``batch``
    sequences of ``query_len`` new tokens each (K/V stores included in both)."""
    _, hq, hkv, d = shape
    layers = make_layers(shape, batch, context, block_size, query_len=query_len)
    gen = torch.Generator().manual_seed(1)
    t = batch * query_len
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    rows_backend, sdpa_backend = CpuAttentionBackend(), TorchAttentionBackend()
    rows_backend.rows_always_query_len = query_len  # rows at every length timed
    outs: dict[str, torch.Tensor] = {}

    def path(name: str, backend: Any) -> Any:
        def fn() -> None:
            for k_pool, v_pool, meta in layers:
                outs[name] = backend.forward(q, k, v, k_pool, v_pool, meta, d**-0.5)

        return fn

    times = {"rows": time_pass(path("rows", rows_backend), repeats),
             "sdpa": time_pass(path("sdpa", sdpa_backend), repeats)}  # fmt: skip
    return {
        "batch": batch, "context": context, "query_len": query_len,
        **{f"{name}_ms": 1e3 * sec for name, sec in times.items()},
        "rows_speedup": times["sdpa"] / times["rows"],
        "max_abs_diff": float((outs["rows"] - outs["sdpa"]).abs().max()),
    }  # fmt: skip


def run(
    shape_name: str, batches: list[int], contexts: list[int], threads: list[int],
    block_size: int, repeats: int, query_lens: list[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every (threads, batch, context[, query length]); return the result table."""
    cpu_native.load()
    shape = SHAPES[shape_name]
    results = []
    for n in threads:
        torch.set_num_threads(n)
        for batch in batches:
            for context in contexts:
                if query_lens:
                    for q_len in query_lens:
                        row = {"threads": n, **run_query_len_config(
                            shape, batch, context, q_len, block_size, repeats)}  # fmt: skip
                        results.append(row)
                        print(f"threads {n} batch {batch:3d} context {context:5d} query "
                              f"{q_len:3d}: rows {row['rows_ms']:8.3f} ms  sdpa "
                              f"{row['sdpa_ms']:8.3f} ms  x{row['rows_speedup']:.2f}")  # fmt: skip
                    continue
                row = {"threads": n, **run_config(shape, batch, context, block_size, repeats)}
                results.append(row)
                print(f"threads {n} batch {batch:3d} context {context:5d}: native "
                      f"{row['native_ms']:8.3f} ms ({row['native_gbps']:5.1f} GB/s)  torch "
                      f"{row['torch_ms']:8.3f} ms  read {row['read_ms']:8.3f} ms  "
                      f"x{row['native_speedup']:.2f}")  # fmt: skip
    layers, hq, hkv, d = shape
    return {"shape": shape_name, "layers": layers, "num_heads": hq, "num_kv_heads": hkv,
            "head_dim": d, "block_size": block_size, "dtype": "float32", "repeats": repeats,
            "results": results, **run_info("real")}  # fmt: skip


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write cpu_attention.json into out_dir; return it."""
    args = settings(cfg)
    result = run(args.shape, args.batch, args.context, args.threads, args.block_size,
                 args.repeats, args.query_len)  # fmt: skip
    print(f"wrote {write_json(out_dir, 'cpu_attention.json', result)}")
    return result


def main() -> None:
    """``python -m experiments.cpu_attention [key=value ...]`` (configs/cpu_attention.yaml)."""
    hydra_app("cpu_attention", write)


if __name__ == "__main__":
    main()
