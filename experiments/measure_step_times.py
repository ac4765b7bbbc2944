"""Measure the real engine's decode step time at several batch sizes and context lengths and
write it as a cost-model calibration file (``paged_llm/sim/calibration.py`` format).
``python -m experiments.measure_step_times calibration.hardware=... calibration.model=...``"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from paged_llm.metrics.run_info import run_info
from paged_llm.sim.settings import ServingSettings
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
