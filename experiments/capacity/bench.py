"""How fast the capacity search runs: the simulator's iterations and simulated requests per
second on one probe of a long trace, one deployment's whole bracketing search on a shorter
trace (the peer, same run), and the time a search of N deployments on a trace of the long
length would take on C cores, extrapolated from them (labelled as such). Writes JSON.

    python -m experiments.capacity.bench [--trace CSV] [--hours 1] [--short-s 600] [--rate 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from experiments.capacity_plan import evaluate, resolved
from paged_llm.metrics.run_info import cpu_name, run_info
from paper_repro.common import compose

OPTIONS = (  # flag, type, default, help
    ("--trace", str, None, "a length CSV (default: synthetic ShareGPT)"),
    ("--hours", float, 1.0, "the long trace's arrival span"),
    ("--short-s", float, 600.0, "the peer search's trace (s)"),
    ("--rate", float, 2.0, "the long probe's rate (req/s)"),
    ("--configs", int, 500, "deployments in the extrapolated search"),
    ("--cores", int, 2, "jobs in parallel in the extrapolated search"),
    ("--out", str, "outputs/capacity_bench.json", "the JSON written"),
)


def probe_speed(c: dict[str, Any], rate: float) -> dict[str, Any]:
    """One simulated run of the configured deployment at ``rate`` over the whole trace."""
    from experiments.capacity.deployment import Deployment
    from experiments.capacity.evaluate import Prober
    from experiments.capacity.rate_search import SLO

    dep = Deployment(**c["deployment"])
    ex = dep.executor(c["model_shape"], c["cost"])
    s = dep.settings(c["engine"])
    s = s.with_overrides(num_gpu_blocks=ex.num_blocks(s, ex.cost_model(s.block_size)))
    prober = Prober(ex, dep.policy, s, c["workload"], [0], SLO(**c["slo"]), early_fraction=0.0)
    point = prober(rate)
    return {"rate": rate, "meets_slo": point.meets, **prober.speed()}


def main() -> None:
    """Measure, extrapolate, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    for flag, kind, default, what in OPTIONS:
        ap.add_argument(flag, type=kind, default=default, help=what)
    a = ap.parse_args()
    base = ["workload.path=" + a.trace] if a.trace else []
    long_cfg = resolved(compose("capacity_plan", [*base, f"workload.duration_s={a.hours * 3600}"]))
    short_cfg = resolved(compose("capacity_plan", [*base, f"workload.duration_s={a.short_s}"]))
    t0 = time.process_time()
    probe = probe_speed(long_cfg, a.rate)
    t1 = time.process_time()
    search = evaluate(short_cfg)
    t2 = time.process_time()
    per_config_short = t2 - t1
    scale = a.hours * 3600 / a.short_s  # a probe's work grows with the trace's length
    per_config_long = per_config_short * scale
    result = {
        "what": "simulated capacity search speed: measured on this CPU, then extrapolated",
        "long_probe": {**probe, "cpu_s": t1 - t0, "trace_s": a.hours * 3600},
        "short_search": {
            "trace_s": a.short_s,
            "cpu_s": per_config_short,
            "probes": len(search["rate"]["points"]),
            "rate": search["rate"]["text"],
            "simulator": search["simulator"],
        },  # fmt: skip
        "extrapolated": {
            "how": "one deployment's search on the short trace x (long / short trace length), "
            "times the deployments, over the cores (jobs in parallel, no sharing)",
            "per_config_cpu_s": per_config_long,
            "configs": a.configs,
            "cores": a.cores,
            "search_wall_min": per_config_long * a.configs / a.cores / 60,
            "target_wall_min": 30.0,
        },  # fmt: skip
        "deployment": long_cfg["deployment"],
        "workload": search["workload"],
        "run_info": {
            **run_info("simulated", hardware=search["hardware"]),
            "computed_on": f"{cpu_name()} (CPU), process time",
            "load_avg_1_5_15_min": os.getloadavg(),  # other tenants of the machine
        },  # fmt: skip
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    e = result["extrapolated"]
    print(f"simulator: {probe['iterations_per_s']:.0f} iterations/s, {probe['requests_per_s']:.0f} "
          f"simulated requests/s ({a.hours:g} h trace at {a.rate:g} req/s); one search on a "
          f"{a.short_s:g} s trace: {per_config_short:.1f} CPU s; extrapolated: "
          f"{e['search_wall_min']:.0f} min for {a.configs} deployments on a {a.hours:g} h trace "
          f"on {a.cores} cores (target 30); {out}")  # fmt: skip


if __name__ == "__main__":
    main()
