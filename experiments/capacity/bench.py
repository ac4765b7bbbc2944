"""How fast the capacity search runs: the simulator's iterations and simulated requests per
second on one probe of a long trace, one deployment's whole bracketing search on a shorter
trace (the peer, same run), and the time a search of N deployments on a trace of the long
length would take on C cores, extrapolated from them (labelled as such). With ``--sample K``,
also the searches of K deployments drawn (seeded) from capacity_plan's search space, and the
extrapolation from their mean. With ``--search CONFIG``, instead: runs that config's whole
multirun (e.g. capacity_plan_large: 512 deployments on a 1-hour trace by branch and bound) in
a child process and records its wall time, its CPU seconds and what each job did. Writes JSON.

    python -m experiments.capacity.bench [--trace CSV] [--hours 1] [--short-s 600] [--rate 2]
        [--sample 12 --sample-s 180] [--set rate_search.first_guess=null]
    python -m experiments.capacity.bench --search capacity_plan_large [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from experiments.capacity.space import apply, grid
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
    ("--sample", int, 0, "deployments drawn from the search space and searched (0: none)"),
    ("--sample-s", float, 180.0, "the sampled searches' trace (s)"),
    ("--sample-seed", int, 0, "which deployments are drawn"),
    ("--search", str, None, "run this config's multirun whole and time it (no extrapolation)"),
    ("--search-dir", str, "outputs/capacity_bench_search", "that multirun's sweep directory"),
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


def space(overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """capacity_plan's resolved config and its sweepers' search space (hydra.sweeper.params)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from paper_repro.common import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose("capacity_plan", overrides=overrides, return_hydra_config=True)
    return resolved(cfg), OmegaConf.to_container(cfg.hydra.sweeper.params)


def sample_searches(a: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """Search ``a.sample`` deployments drawn from the space on an ``a.sample_s`` trace; scale
    each one's CPU seconds to the long trace and extrapolate the whole search from the mean."""
    cfg, params = space([*overrides, f"workload.duration_s={a.sample_s}"])
    jobs = random.Random(a.sample_seed).sample(grid(params), a.sample)
    scale = a.hours * 3600 / a.sample_s
    rows = []
    for job in jobs:
        t0 = time.process_time()
        r = evaluate(apply(cfg, job))
        cpu = time.process_time() - t0
        rows.append({"deployment": r["label"], "cpu_s": cpu, "long_cpu_s": cpu * scale,
                     "probes": len(r["rate"]["points"]) if "rate" in r else 0,
                     "rate": (r.get("rate") or {}).get("text", r["status"]),
                     "simulated": (r.get("simulator") or {}).get("requests", 0)})  # fmt: skip
        print(f"  {rows[-1]['deployment']}: {rows[-1]['rate']} req/s, {rows[-1]['probes']} "
              f"probes, {cpu:.1f} CPU s", flush=True)  # fmt: skip
    long = [r["long_cpu_s"] for r in rows]
    mean, sd = statistics.mean(long), statistics.stdev(long) if len(long) > 1 else 0.0
    half = 1.96 * sd / math.sqrt(len(long))  # the mean's normal 95% interval
    wall = lambda per_config: per_config * a.configs / a.cores / 60  # noqa: E731
    return {
        "how": f"{a.sample} deployments drawn (seed {a.sample_seed}) from capacity_plan's "
        f"hydra.sweeper.params; each searched on a {a.sample_s:g} s trace, its CPU seconds "
        f"x (long / sample trace length); the search's wall time = the mean x deployments / "
        "cores (jobs in parallel, no sharing)",
        "trace_s": a.sample_s, "scale": scale, "overrides": overrides, "searches": rows,
        "probes_total": sum(r["probes"] for r in rows),
        "per_config_long_cpu_s": {"mean": mean, "sd": sd, "min": min(long), "max": max(long)},
        "search_wall_min": wall(mean),
        "search_wall_min_95ci": [wall(mean - half), wall(mean + half)],
        "configs": a.configs, "cores": a.cores, "target_wall_min": 30.0,
    }  # fmt: skip


def timed_search(config: str, sweep_dir: str, overrides: list[str]) -> dict[str, Any]:
    """Run ``config``'s multirun in a child process; its wall and CPU seconds (the child and
    its workers), and per job: the deployment, its answer or bound, probes, simulated CPU."""
    import resource
    import subprocess
    import sys

    from experiments.capacity.report import collect

    cmd = [sys.executable, "-m", "experiments.capacity_plan", "--config-name", config, "-m",
           f"hydra.sweep.dir={sweep_dir}", *overrides]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = os.getloadavg(), time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    jobs = collect(Path(sweep_dir))
    rows = [{"deployment": j["label"], "status": j["status"],
             "rate": (j.get("rate") or {}).get("text", j["status"]),
             "kind": (j.get("rate") or {}).get("kind"),
             "probes": len((j.get("rate") or {}).get("points", [])),
             "sim_cpu_s": (j.get("simulator") or {}).get("sim_cpu_s", 0.0),
             "requests_per_dollar": j["requests_per_dollar"],
             "busy_bound_share": j.get("busy_bound_share")} for j in jobs]  # fmt: skip
    kinds = Counter(str(r["kind"] or r["status"]) for r in rows)
    best = max(rows, key=lambda r: r["requests_per_dollar"])
    shares = [r["busy_bound_share"] for r in rows if r["busy_bound_share"] is not None]
    return {
        "what": "a whole capacity search, run (not extrapolated): wall seconds of the multirun, "
        "CPU seconds of it and its workers",
        "command": "python -m experiments.capacity_plan --config-name " + " ".join(cmd[4:]),
        "wall_s": wall, "wall_min": wall / 60, "cpu_s": cpu, "target_wall_min": 30.0,
        "load_avg_1_5_15_min_before": load0, "load_avg_1_5_15_min_after": os.getloadavg(),
        "configs": len(rows), "answers": dict(kinds), "probes": sum(r["probes"] for r in rows),
        "sim_cpu_s": sum(r["sim_cpu_s"] for r in rows), "best": best,
        "busy_bound_share_max": max(shares) if shares else None,
        "jobs": sorted(rows, key=lambda r: -r["sim_cpu_s"]),
    }  # fmt: skip


def main() -> None:
    """Measure, extrapolate, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    for flag, kind, default, what in OPTIONS:
        ap.add_argument(flag, type=kind, default=default, help=what)
    ap.add_argument("--set", action="append", default=[], help="a capacity_plan override")
    a = ap.parse_args()
    if a.search:
        info = run_info("simulated", hardware="see each job's result")
        info["computed_on"] = f"{cpu_name()} (CPU), {os.cpu_count()} cores"
        result = {**timed_search(a.search, a.search_dir, a.set), "run_info": info}
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"{result['configs']} deployments searched in {result['wall_min']:.1f} min wall "
              f"({result['cpu_s']:.0f} CPU s; target 30 min): {result['answers']}, "
              f"{result['probes']} probes; best {result['best']['deployment']} at "
              f"{result['best']['rate']} req/s; {out}")  # fmt: skip
        return
    base = (["workload.path=" + a.trace] if a.trace else []) + a.set
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
        "sampled": sample_searches(a, base) if a.sample else None,
        "deployment": long_cfg["deployment"],
        "workload": search["workload"],
        "run_info": {
            **run_info("simulated", hardware=search["hardware"]),
            "computed_on": f"{cpu_name()} (CPU), process time",
            "load_avg_1_5_15_min": os.getloadavg(),  # other tenants of the machine
            "cpu_s_total": time.process_time(),
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
    if a.sample:
        sm = result["sampled"]
        lo, hi = sm["search_wall_min_95ci"]
        print(f"sampled {a.sample} deployments ({sm['probes_total']} probes): extrapolated "
              f"{sm['search_wall_min']:.0f} min (the mean's 95% interval: {lo:.0f} to "
              f"{hi:.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
