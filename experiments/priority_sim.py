"""Priority scheduling against first come first served, under rising load.

A share of the requests (``urgent_fraction``, drawn with ``priority_seed``) is urgent. Each
request rate runs twice with the same arrivals and lengths: FCFS (no priorities, which an FCFS
engine refuses, as vLLM's), and ``scheduling_policy=priority`` with the urgent requests at
priority 0 and the rest at 1. Reported per class: the paper's normalized latency (s/token),
TTFT and E2EL, so the cost to the other requests is beside the gain of the urgent ones.
``python -m experiments.priority_sim [overrides]`` (simulated OPT-13B on an A100-40GB by
default; ``executor=real`` runs the real engine). Writes priority_sim.json / .csv / .png.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from paged_llm.metrics.serving import serving_metrics
from paged_llm.workloads.arrivals import Workload
from paper_repro.common import figure, hydra_output_dir, setup, write_results

CLASSES = {"urgent": 0, "other": 1}  # class name -> priority
REPORTED = ("normalized_latency", "median_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "completed")


def draw_classes(workload: Workload, urgent_fraction: float, seed: int) -> dict[str, str]:
    """Request id -> class: a seeded ``urgent_fraction`` of the requests are urgent."""
    rng = random.Random(seed)
    return {
        r.request_id: "urgent" if rng.random() < urgent_fraction else "other"
        for r in workload.requests
    }


def with_priorities(workload: Workload, classes: dict[str, str]) -> Workload:
    """The same requests, each with its class's priority."""
    requests = [replace(r, priority=CLASSES[classes[r.request_id]]) for r in workload.requests]
    return replace(workload, requests=requests)


def class_metrics(trace: Any, classes: dict[str, str]) -> dict[str, dict[str, Any]]:
    """serving_metrics of each class's requests, and of all of them."""
    out = {"all": serving_metrics(trace)}
    for name in CLASSES:
        mine = [r for r in trace.requests if classes[r.request_id] == name]
        out[name] = serving_metrics(replace(trace, requests=mine))
    return {k: {m: v[m] for m in (*REPORTED, "num_preemptions")} for k, v in out.items()}


def plot(result: dict[str, Any], rates: list[float], title: str) -> Any:
    """Normalized latency and median TTFT vs request rate, per scheduling policy and class."""
    fig, axes = figure(ncols=2, width=5.0, height=3.8)
    for ax, metric, label in zip(
        axes[0], ("normalized_latency", "median_ttft_ms"), ("normalized latency (s/token)",
                                                             "median TTFT (ms)")
    ):  # fmt: skip
        for policy, style in (("fcfs", "-"), ("priority", "--")):
            for cls, marker in (("urgent", "o"), ("other", "s")):
                ys = [result["runs"][str(r)][policy][cls][metric] for r in rates]
                ax.plot(rates, ys, style, marker=marker, label=f"{policy}, {cls}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8, y=-0.02)
    return fig


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Run FCFS and priority at every rate; write the results into ``out_dir``."""
    exp = setup(cfg, out_dir)
    c = exp.cfg
    rates = [float(r) for r in c["request_rates"]]
    result: dict[str, Any] = {"urgent_fraction": c["urgent_fraction"], "runs": {}}
    rows, used = [], []
    for rate in rates:
        workload = exp.workload(request_rate=rate)
        used.append(workload)
        classes = draw_classes(workload, c["urgent_fraction"], c["priority_seed"])
        runs = {"fcfs": workload, "priority": with_priorities(workload, classes)}
        result["runs"][str(rate)] = {}
        for policy, requests in runs.items():
            settings = exp.settings(c["kv_policy"], scheduling_policy=policy)
            trace = exp.run(requests, c["kv_policy"], settings)
            per_class = class_metrics(trace, classes)
            result["runs"][str(rate)][policy] = per_class
            for cls, m in per_class.items():
                rows.append({"request_rate": rate, "scheduling_policy": policy, "class": cls, **m})
                exp.logger.log({f"{rate}/{policy}/{cls}/{k}": v for k, v in m.items()})
    result["run_info"] = exp.provenance(used)
    title = f"priority scheduling, {c['urgent_fraction']:.0%} urgent, {exp.label(used)}"
    paths = write_results(exp, "priority_sim", result, rows, plot(result, rates, title))
    exp.logger.finish()
    print(f"{'rate':>5} {'policy':9} {'class':7} {'s/token':>8} {'TTFT p50 ms':>12} {'p99 ms':>9}")
    for r in rows:
        print(
            f"{r['request_rate']:5.2f} {r['scheduling_policy']:9} {r['class']:7} "
            f"{r['normalized_latency']:8.3f} {r['median_ttft_ms']:12.0f} {r['p99_ttft_ms']:9.0f}"
        )
    print(f"priority_sim ({exp.executor.describe()}): {', '.join(str(p) for p in paths)}")
    return result


@hydra.main(config_path="../configs", config_name="priority_sim", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
