"""One serving run: a workload (trace or synthetic lengths, Poisson arrivals) through one
policy, simulated on a GPU cost model or run on the real engine, reporting vLLM's serving
metrics. ``python -m experiments.serve_sim [overrides]``; sweeps are Hydra multiruns
(``-m workload.request_rate=0.5,1,1.5 policy=paged,orca_oracle``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from paged_llm.core.kv import POLICIES
from paged_llm.metrics.serving import mean_batched_requests, memory_shares, serving_metrics
from paper_repro.common import hydra_output_dir, setup, write_results


def policy_name(spec: Any) -> str:
    """The POLICIES name of a ``policy`` config (``{_target_: ...}``) or the spec itself."""
    target = spec.get("_target_") if isinstance(spec, dict) else spec
    return next((name for name, path in POLICIES.items() if path == target), str(target))


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Run once; write serve_sim.json (metrics, provenance, resolved config) into ``out_dir``."""
    exp = setup(cfg, out_dir)
    c = exp.cfg
    name = policy_name(c["policy"])
    settings = exp.settings(name)
    workload = exp.workload()
    window = tuple(c["window"]) if c.get("window") else None
    trace = exp.run(
        workload, c["policy"], settings, stop_time=c.get("stop_time_s"), memory_window=window
    )
    metrics = serving_metrics(trace)
    metrics["mean_batched_requests"] = mean_batched_requests(trace.iterations, window)
    metrics["iterations"] = len(trace.iterations)
    if "prefix_cache_hit_rate" in trace.extra:
        metrics["prefix_cache_hit_rate"] = trace.extra["prefix_cache_hit_rate"]
    if "kv_offload" in trace.extra:  # the prefix cache's CPU tier, in blocks
        metrics.update({f"kv_offload_{k}": v for k, v in trace.extra["kv_offload"].items()})
    if any(it.memory is not None for it in trace.iterations):
        metrics["memory_shares"] = memory_shares(trace.iterations, window)
    result = {
        "policy": name,
        "metrics": metrics,
        "settings": settings.to_dict(),
        "num_kv_blocks": trace.num_kv_blocks,
        "workload": workload.describe(),
        "wall_time_s": trace.wall_time_s,
        "run_info": exp.provenance([workload]),
    }
    exp.logger.log({k: v for k, v in metrics.items() if isinstance(v, int | float)})
    write_results(exp, "serve_sim", result, [], None)
    exp.logger.finish()
    print(json.dumps({k: metrics[k] for k in list(metrics)[:20] if k != "memory_shares"}, indent=1))
    print(f"{name} ({trace.hardware}, {workload.source}): {exp.out_dir / 'serve_sim.json'}")
    return result


@hydra.main(config_path="../configs", config_name="serve_sim", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
