"""Fig. 13: mean number of requests batched per iteration, per policy and workload.
``python -m paper_repro.fig13 [overrides]``"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from paged_llm.metrics.serving import mean_batched_requests, serving_metrics
from paper_repro.common import Experiment, figure, hydra_output_dir, setup, write_results
from paper_repro.paper_numbers import FIG13, FIG13_TOLERANCE
from paper_repro.seeds import error_bars, over_seeds, stat
from paper_repro.verdicts import check


def acceptance(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's check: paged and Orca (Oracle) on ShareGPT within 15% of the paper."""
    checks = {}
    for policy in ("paged", "orca_oracle"):
        ours = result.get("sharegpt", {}).get(policy, {}).get("mean_batched_requests")
        if ours is None:
            continue
        paper = FIG13["sharegpt"][policy]
        err = ours / paper - 1
        checks[f"sharegpt_{policy}"] = check(
            ours, paper, f"within {FIG13_TOLERANCE:.0%}", abs(err) <= FIG13_TOLERANCE,
            relative_error=err,
        )  # fmt: skip
    return checks


def plot(result: dict[str, Any], workloads: list[str], policies: list[str], title: str) -> Any:
    """Grouped bars, ours beside the paper's, one panel per workload."""
    fig, axes = figure(ncols=len(workloads), width=5.0, height=3.8)
    for ax, w in zip(axes[0], workloads):
        xs = range(len(policies))
        ours = [result[w][p]["mean_batched_requests"] for p in policies]
        paper = [FIG13.get(w, {}).get(p, 0) for p in policies]
        yerr = error_bars(result, [f"{w}/{p}/mean_batched_requests" for p in policies])
        ax.bar([x - 0.2 for x in xs], ours, width=0.4, yerr=yerr, capsize=3, label="ours (95% CI)")
        ax.bar([x + 0.2 for x in xs], paper, width=0.4, label="paper", alpha=0.6)
        for x, v in zip(xs, ours):
            ax.text(x - 0.2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), policies, fontsize=8)
        ax.set_title(f"{w} @ {result[w]['request_rate']:g} req/s", fontsize=9)
        ax.set_ylabel("mean batched requests")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8, y=-0.02)
    return fig


def measure(exp: Experiment) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """One seed: every policy on every workload; mean batched requests per policy, CSV rows."""
    c = exp.cfg
    result: dict[str, Any] = {}
    rows = []
    used = []
    for wname, spec in c["workloads"].items():
        window = tuple(c["windows"][wname])
        workload = exp.workload(base=spec)
        used.append(workload)
        result[wname] = {"request_rate": workload.request_rate, "window_s": list(window)}
        for policy in c["policies"]:
            trace = exp.run(
                workload, policy, exp.settings(policy), stop_time=window[1], memory_every=0
            )
            batched = mean_batched_requests(trace.iterations, window)
            m = serving_metrics(trace)
            result[wname][policy] = {
                "mean_batched_requests": batched,
                "completed": m["completed"],
                "num_preemptions": m["num_preemptions"],
            }
            rows.append(
                {
                    "workload": wname,
                    "policy": policy,
                    "request_rate": workload.request_rate,
                    "mean_batched_requests": batched,
                    "paper": FIG13.get(wname, {}).get(policy),
                }
            )
            exp.logger.log({f"{wname}/{policy}/mean_batched_requests": batched})
    return result, rows, used


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Run every policy on every workload, once per seed; write fig13.json / .csv / .png
    (means and 95% intervals over the seeds) into ``out_dir``."""
    exp = setup(cfg, out_dir)
    c = exp.cfg
    result, rows, used = over_seeds(exp, measure)
    result["acceptance"] = acceptance(result)  # on the means
    result["paper"] = FIG13
    result["run_info"] = exp.provenance(used)
    policies = list(c["policies"])
    workloads = list(c["workloads"])
    n = result["seeds"]["n"]
    title = f"Fig. 13, {exp.label(used)}, mean of {n} seed{'s' * (n > 1)}"
    paths = write_results(exp, "fig13", result, rows, plot(result, workloads, policies, title))
    exp.logger.finish()
    for w in workloads:
        for p in policies:
            s = stat(result, f"{w}/{p}/mean_batched_requests") or {}
            ci = (
                "" if s.get("ci95_low") is None else f" [{s['ci95_low']:.2f}, {s['ci95_high']:.2f}]"
            )
            paper = FIG13.get(w, {}).get(p)
            print(
                f"{w:9s} {p:12s} {result[w][p]['mean_batched_requests']:7.2f}{ci} "
                f"(paper {paper if paper is not None else '-'})"
            )
    print(f"fig13 ({exp.executor.describe()}, {n} seeds): {', '.join(str(p) for p in paths)}")
    return paths


@hydra.main(config_path="../configs", config_name="fig13", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
