"""Host time of building one step's inputs (the step profile's ``inputs`` phase), on the CPU:
a CUDA graph's static buffers loaded for a decode step at batch 256 and a mixed step (255
decodes beside a 257-token prompt, the 512-token graph), and the eager path's metadata for the
same mixed step; contexts 200-1800 tokens, block size 16, max_model_len 2048 (LLaMA-7B's end-
to-end workload on the GPU). The peer, measured in the same run: the list-to-tensor conversion
both paths make, by ``torch.tensor`` (before) and by ``runner.batch.int_tensor`` (now).

    python -m experiments.bench_step_inputs [reps=30]   # JSON in the Hydra run directory

Host-side work only (the tensors stay on the CPU): on a GPU a step also pays the copies.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from experiments.common.cli import command, hydra_app, settings
from experiments.common.hardware import host_info
from paged_llm.attention.metadata import build_attention_metadata
from paged_llm.metrics.run_info import write_json
from paged_llm.runner.batch import BlockTableRows, int_tensor
from paged_llm.runner.cuda_graphs import CudaGraphRunner, mixed_capture_tokens

BLOCK_SIZE, MAX_MODEL_LEN = 16, 2048


def host_batch(num_decodes: int, prompt: int, seed: int = 0) -> Any:
    """A HostBatch-like step: decodes at random contexts, then one prompt of ``prompt`` tokens."""
    rng = random.Random(seed)
    contexts = [rng.randint(200, 1800) for _ in range(num_decodes)] + ([prompt] if prompt else [])
    queries = [1] * num_decodes + ([prompt] if prompt else [])
    tables = [rng.sample(range(20000), -(-c // BLOCK_SIZE)) for c in contexts]
    rows = BlockTableRows()  # the tables as the runner hands them on (int64 rows)
    tables = [rows.row(str(i), t) for i, t in enumerate(tables)]
    positions = [p for q, c in zip(queries, contexts) for p in range(c - q, c)]
    return SimpleNamespace(input_ids=[5] * len(positions), positions=positions,
                           query_lens=queries, seq_lens=contexts, block_tables=tables)  # fmt: skip


def ms_per_call(fn: Any, reps: int) -> float:
    """Median of 5 timings of ``reps`` calls, in ms per call."""
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return 1e3 * sorted(times)[2]


def time_case(graphs: CudaGraphRunner, batch: Any, reps: int) -> dict[str, Any]:
    """One step's input building: graph load, eager metadata, and the two conversions."""
    key = graphs.key_for(batch)
    flat = [b for t in batch.block_tables for b in t] + batch.input_ids + batch.positions
    meta_args = (batch.query_lens, batch.seq_lens, batch.block_tables, BLOCK_SIZE)
    return {
        "graph_key": list(key),
        "graph_load_ms": ms_per_call(lambda: graphs.load(batch, key), reps),
        "eager_metadata_ms": ms_per_call(lambda: build_attention_metadata(*meta_args), reps),
        "ints": len(flat),
        "torch_tensor_ms": ms_per_call(lambda: torch.tensor(flat, dtype=torch.int64), reps),
        "int_tensor_ms": ms_per_call(lambda: int_tensor(flat), reps),
    }


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Time each case with the config's settings; write bench_step_inputs.json into out_dir."""
    args = settings(cfg)
    graphs = CudaGraphRunner(None, None, [], None, list(range(8, 257, 8)), BLOCK_SIZE,
                             MAX_MODEL_LEN, torch.device("cpu"),
                             mixed_tokens=mixed_capture_tokens(512))  # fmt: skip
    graphs.graphs = dict.fromkeys(graphs.keys)  # key_for only asks which keys exist
    cases = {"decode_256": host_batch(256, 0), "mixed_255_plus_257": host_batch(255, 257)}
    rows = {name: time_case(graphs, batch, args.reps) for name, batch in cases.items()}
    doc = {
        "what": "real host-side timings on the CPU (no model, no device copies)",
        "hardware": host_info("cpu"),
        "command": command("experiments.bench_step_inputs"),
        "cases": rows,
    }
    print(json.dumps(rows, indent=1))
    print(f"wrote {write_json(out_dir, 'bench_step_inputs.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.bench_step_inputs [reps=30]`` (configs/bench_step_inputs.yaml)."""
    hydra_app("bench_step_inputs", write)


if __name__ == "__main__":
    main()
