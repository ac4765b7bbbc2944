"""Measure the real engine's decode step time at several batch sizes and context lengths and
write it as a cost-model calibration file (``paged_llm/sim/calibration.py`` format).
``python -m experiments.measure_step_times calibration.hardware=... calibration.model=...``

``measure_grid`` times mixed steps too (decodes plus a prompt's prefill) and records each
step's exact shape, for the linear step law (``paged_llm/sim/step_law.py``);
``paper_repro.validate_sim`` uses it."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from paged_llm.metrics.run_info import run_info
from paged_llm.sim.settings import ServingSettings
from paged_llm.sim.step_recorder import recorded_shapes
from paper_repro.common import hydra_output_dir


def measure(engine: Any, batch: int, context: int, steps: int) -> float:
    """Median time of a decode step with ``batch`` requests of ``context`` tokens."""
    from paged_llm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"m{batch}-{context}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [3 + i % 500 for i in range(context)]}, params)
    while any(engine.scheduler.requests[r].num_computed_tokens < context for r in ids):
        engine.step()  # prefill (possibly over several steps)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns after sampling, which waits for the device
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    return statistics.median(times)


def measure_mixed(
    engine: Any, batch: int, context: int, prefill: int, steps: int, clock: Callable[[], float]
) -> dict[str, Any]:
    """Median of ``steps`` steps that decode ``batch`` requests of about ``context`` tokens
    and prefill one new ``prefill``-token prompt (either may be 0), timed by ``clock``; the
    point in the explicit calibration form (its shape averaged over the timed steps)."""
    from paged_llm.sampling_params import SamplingParams

    tag = f"g{batch}-{context}-{prefill}"
    decode = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"{tag}-d{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": _prompt(context)}, decode)
    while any(engine.scheduler.requests[r].num_computed_tokens < context for r in ids):
        engine.step()  # the decodes' own prefill, untimed
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # done at its prefill
    times, shapes = [], []
    with recorded_shapes(engine) as seen:
        for i in range(steps):
            if prefill:
                ids.append(f"{tag}-p{i}")
                engine.add_request(ids[-1], {"prompt_token_ids": _prompt(prefill)}, once)
            start = clock()
            engine.step()  # returns after sampling, which waits for the device
            times.append(clock() - start)
            shapes.append(seen[-1])
    engine.abort_request(ids)  # a prompt left waiting must not join the next cell's steps
    t = statistics.median(times)
    point = {k: round(statistics.mean(getattr(s, k) for s in shapes)) for k in SHAPE_KEYS}
    return {**point, "step_time_s": t}


SHAPE_KEYS = ("num_seqs", "num_new_tokens", "kv_tokens_read", "kv_blocks_read", "attn_pairs")


def _prompt(n: int) -> list[int]:
    return [3 + i % 500 for i in range(n)]


def grid_cells(
    batches: list[int],
    contexts: list[int],
    prefills: list[int],
    steps: int,
    blocks: int,
    block_size: int,
) -> list[tuple[int, int, int]]:
    """(batch, context, prefill) cells whose requests fit ``blocks`` KV blocks (else the
    prompt would wait and the step would not be the cell's); one context for batch 0."""
    cells = []
    for b, ctx, pre in itertools.product(batches, contexts, prefills):
        need = b * -(-(ctx + steps + 2) // block_size) + -(-pre // block_size)
        if (b == 0 and (pre == 0 or ctx != contexts[0])) or need > blocks:
            continue
        cells.append((b, ctx, pre))
    return cells


def measure_grid(
    engine: Any, grid: dict[str, Any], clock: Callable[[], float], log: bool = True
) -> list[dict[str, Any]]:
    """Every cell of ``grid`` (batch_sizes, context_tokens, prefill_tokens, steps) that fits
    the engine's KV pool, as explicit calibration points."""
    steps = int(grid["steps"])
    cells = grid_cells(
        list(grid["batch_sizes"]), list(grid["context_tokens"]), list(grid["prefill_tokens"]),
        steps, engine.num_kv_blocks, engine.config.cache.block_size,
    )  # fmt: skip
    points = []
    for b, ctx, pre in cells:
        p = measure_mixed(engine, b, ctx, pre, steps, clock)
        points.append({"batch": b, "context": ctx, "prefill": pre, **p})
        if log:
            print(f"batch {b:3d}, context {ctx:4d}, prefill {pre:4d}: "
                  f"{1000 * p['step_time_s']:.2f} ms per step")  # fmt: skip
    return points


def run(cfg: DictConfig, out_dir: Path) -> Path:
    """Time every (batch, context) point; write step_times.json into ``out_dir``."""
    c = OmegaConf.to_container(cfg, resolve=True)
    executor = instantiate(c["executor"], _convert_="all")
    settings = ServingSettings(**{**c["engine"], "max_num_seqs": max(c["batch_sizes"])})
    engine = executor.engine("paged", settings)
    points = []
    for b in c["batch_sizes"]:
        for ctx in c["context_tokens"]:
            t = measure(engine, int(b), int(ctx), int(c["steps"]))
            # context after the step: prompt + the tokens generated so far (about steps / 2)
            points.append(
                {"num_seqs": b, "context_tokens_per_seq": ctx + c["steps"] // 2, "step_time_s": t}
            )
            print(f"batch {b:3d}, context {ctx:5d}: {1000 * t:.2f} ms per step")
    data = {
        **c["calibration"],
        "block_size": settings.block_size,
        "source": f"measured by experiments.measure_step_times on {executor.describe()}",
        "run_info": run_info("real", str(engine.device), executor.describe()),
        "points": points,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "step_times.json"
    path.write_text(json.dumps(data, indent=2))
    print(f"calibration file: {path}")
    return path


@hydra.main(config_path="../configs", config_name="measure_step_times", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
