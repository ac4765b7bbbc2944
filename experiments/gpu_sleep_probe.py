"""Why a sleep frees tensors but not device memory: the CUDA caching allocator's segments after
``LLM.sleep``, with the allocation stack of every block still live in them.

    python -m experiments.gpu_sleep_probe --out DIR            # the engine (sleep-mode default)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False python -m experiments.gpu_sleep_probe ...
    python -m experiments.gpu_sleep_probe --micro --out DIR    # the allocator alone

``--micro`` allocates interleaved tensors, frees every other one and empties the cache: with
expandable segments the freed pages go back to the driver, without them none do. The engine
probe builds the sleep section's engine (experiments/gpu/memory_features.py), sleeps at level 1
and writes ``sleep_probe.json``: reserved/allocated/used bytes and each segment's size, live
bytes, whether it is expandable, and the live blocks' Python allocation sites. CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from experiments.gpu.memory_features import _allocator_gib, _used_gib, alloc_conf_env

MIB = 2**20


def _memory(device: torch.device) -> dict[str, float]:
    """Device memory used (all processes), this process's reserved and allocated, in MiB."""
    gib = {"used": _used_gib(device), **_allocator_gib(device)}
    return {f"{k}_MiB": v * 1024 for k, v in gib.items()}


def micro(device: torch.device) -> dict[str, Any]:
    """Interleaved 8 MiB tensors, every other one freed, cache emptied: memory before/after
    (PYTORCH_CUDA_ALLOC_CONF sets the allocator)."""
    out: dict[str, Any] = {"start": _memory(device)}
    tensors = [torch.empty(8 * MIB, dtype=torch.uint8, device=device) for _ in range(128)]
    out["allocated"] = _memory(device)
    del tensors[::2]
    torch.cuda.empty_cache()
    out["half_freed"] = _memory(device)
    return out


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frames from this project (or the caller), as file:line name."""
    ours = [f for f in frames if "paged_llm" in f["filename"] or "experiments" in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in ours[:4])


def segments(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Each segment: size, live bytes, expandable or not, and its live blocks' sites."""
    rows = []
    for seg in snapshot["segments"]:
        live = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
        rows.append({
            "total_MiB": seg["total_size"] / MIB,
            "allocated_MiB": seg["allocated_size"] / MIB,
            "expandable": seg.get("is_expandable"),
            "pool": str(seg.get("segment_pool_id")),
            "live_blocks": [
                {"MiB": round(b["size"] / MIB, 3), "site": _site(b.get("frames", []))}
                for b in live[:12]
            ],
        })  # fmt: skip
    return sorted(rows, key=lambda r: -r["total_MiB"])


def warm_up(device: torch.device) -> dict[str, float]:
    """CUDA work before the engine, as the GPU check's bandwidth section (or a trainer) does:
    a 1 GiB copy and a bf16 matmul (whose cuBLAS workspace stays allocated), all freed."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device=device).normal_()
    src.clone()
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    a @ a
    del src, a
    return _memory(device)


def engine_probe(device: torch.device, workdir: Path, warm: bool, mempool: bool) -> dict[str, Any]:
    """The sleep section's engine: memory awake and asleep, and the segments asleep."""
    from experiments.gpu.memory_features import _checkpoint
    from experiments.gpu.plans import PLANS
    from paged_llm import LLM, SamplingParams

    torch.cuda.memory._record_memory_history(max_entries=200_000)
    path = _checkpoint(PLANS["full"], workdir)
    before = warm_up(device) if warm else None
    pool = torch.cuda.MemPool() if mempool else None  # the engine's own segments
    with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
        llm = LLM(
            str(path), device=str(device), dtype="bfloat16", enable_sleep_mode=True,
            enable_prefix_caching=True, block_size=16, num_gpu_blocks_override=512,
            max_model_len=8192, max_num_seqs=16, seed=0,
        )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 40))}] * 4, params, use_tqdm=False)
    out: dict[str, Any] = {"warm_up": before, "awake": _memory(device)}
    llm.sleep(1)
    out["asleep"] = _memory(device)
    out["segments_asleep"] = segments(torch.cuda.memory._snapshot())
    llm.wake_up()
    out["woken"] = _memory(device)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the probe; write and return its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro", action="store_true", help="the allocator alone")
    parser.add_argument("--warm-up", action="store_true", help="CUDA work before the engine")
    parser.add_argument("--mempool", action="store_true", help="build the engine in a MemPool")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the probe reads the CUDA caching allocator: it needs a GPU")
    device = torch.device("cuda")
    doc: dict[str, Any] = {
        "measured": True,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "alloc_conf_env": alloc_conf_env(),
    }
    if args.micro:
        doc["micro"] = micro(device)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            doc["engine"] = engine_probe(device, Path(tmp), args.warm_up, args.mempool)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sleep_probe.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
