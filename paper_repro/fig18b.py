"""Fig. 18b: normalized latency vs KV block size (1..256), paged policy.
``python -m paper_repro.fig18b`` runs every block size; ``-m block_size=1,2,...,256`` runs one
per Hydra job and :class:`CollectSweep` merges the jobs' results into the sweep directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from paged_llm.metrics.serving import mean_batched_requests, serving_metrics
from paged_llm.metrics.sweep import SweepSummary
from paper_repro.common import Experiment, figure, hydra_output_dir, setup, write_results
from paper_repro.paper_numbers import FIG18B
from paper_repro.seeds import over_seeds


def point(exp: Experiment, workload: Any, block_size: int) -> dict[str, Any]:
    """One run at one block size, with the pool's token slots held constant."""
    c = exp.cfg
    settings = exp.settings(
        c["kv_policy"],
        block_size=block_size,
        num_gpu_blocks=int(c["kv_cache_tokens"]) // block_size,
    )
    trace = exp.run(workload, c["kv_policy"], settings, memory_every=0)
    m = serving_metrics(trace)
    return {
        "block_size": block_size,
        "normalized_latency": m["normalized_latency"],
        "request_rate": workload.request_rate,
        "mean_batched_requests": mean_batched_requests(trace.iterations),
        "request_throughput": m["request_throughput"],
        "num_preemptions": m["num_preemptions"],
        "num_kv_blocks": trace.num_kv_blocks,
    }


def plot(curves: dict[str, list[dict[str, Any]]], title: str) -> Any:
    """Normalized latency vs block size (log-log), ours and the paper's, per workload."""
    fig, axes = figure(ncols=len(curves), width=4.8, height=3.8)
    for ax, (w, pts) in zip(axes[0], curves.items()):
        ys = [p["normalized_latency"] for p in pts]
        ends = [p.get("ci95", {}).get("normalized_latency") or [y, y] for p, y in zip(pts, ys)]
        yerr = [[y - lo for y, (lo, _) in zip(ys, ends)], [hi - y for y, (_, hi) in zip(ys, ends)]]
        xs = [p["block_size"] for p in pts]
        ax.errorbar(xs, ys, yerr=yerr, fmt="o-", capsize=2, label="ours (95% CI)")
        paper = FIG18B.get(w, {})
        ax.plot(list(paper), list(paper.values()), "s--", alpha=0.6, label="paper")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("normalized latency (s/token)")
        rate = pts[0]["request_rate"] if pts else "?"
        ax.set_title(f"{w} @ {rate} req/s", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8, y=-0.02)
    return fig


def point_row(p: dict[str, Any]) -> dict[str, Any]:
    """A CSV row: the point's means, then each quantity's interval ends as columns."""
    row = {k: v for k, v in p.items() if k != "ci95"}
    for k, (lo, hi) in p.get("ci95", {}).items():
        row[f"{k}_ci95_low"], row[f"{k}_ci95_high"] = lo, hi
    return row


def finish(
    exp: Experiment, curves: dict[str, list[dict[str, Any]]], info: dict[str, Any]
) -> list[Path]:
    """Write fig18b.json / .csv / .png for the given curves."""
    for pts in curves.values():
        pts.sort(key=lambda p: p["block_size"])
    result = {**curves, "paper": FIG18B, "run_info": info, "seeds": info.get("seeds")}
    rows = [{"workload": w, **point_row(p)} for w, pts in curves.items() for p in pts]
    fig = plot(curves, f"Fig. 18b, {info.get('hardware', '')}")
    return write_results(exp, "fig18b", result, rows, fig)


def measure(exp: Experiment) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """One seed: the configured block size(s) for every workload."""
    c = exp.cfg
    sizes = [int(c["block_size"])] if c.get("block_size") else [int(b) for b in c["block_sizes"]]
    curves: dict[str, list[dict[str, Any]]] = {}
    used = []
    for wname, spec in c["workloads"].items():
        workload = exp.workload(base=spec)
        used.append(workload)
        curves[wname] = [point(exp, workload, b) for b in sizes]
    rows = [{"workload": w, **p} for w, pts in curves.items() for p in pts]
    return curves, rows, used


def with_intervals(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The mean curves, each point carrying its quantities' intervals (``ci95``: key -> [low,
    high]), so that a sweep's jobs can be merged by block size."""
    stats = result["seeds"]["stats"]
    curves = {w: pts for w, pts in result.items() if w != "seeds"}
    for w, pts in curves.items():
        for i, p in enumerate(pts):
            own = {k: stats.get(f"{w}/{i}/{k}") for k in p}
            p["ci95"] = {k: [s["ci95_low"], s["ci95_high"]] for k, s in own.items() if s}
    return curves


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Run the configured block size(s) for every workload, once per seed; write the results
    (means, with each point's 95% interval over the seeds) into ``out_dir``."""
    exp = setup(cfg, out_dir)
    result, _, used = over_seeds(exp, measure)
    seeds = {k: v for k, v in result["seeds"].items() if k != "stats"}
    curves = with_intervals(result)
    info = {**exp.provenance(used), "seeds": seeds}
    for w, pts in curves.items():  # the mean curves, one logged point per block size
        for p in pts:
            exp.logger.log(
                {f"{w}/normalized_latency": p["normalized_latency"], "block_size": p["block_size"]}
            )
    paths = finish(exp, curves, info)
    exp.logger.finish()
    for w, pts in curves.items():
        text = ", ".join(f"{p['block_size']}: {p['normalized_latency']:.3f}" for p in pts)
        print(f"{w}: normalized latency by block size {text}")
    print(f"fig18b ({exp.executor.describe()}): {', '.join(str(p) for p in paths)}")
    return paths


# The generic sweep table's columns: each job's first block size per workload.
SWEEP_COLUMNS = {
    "mode": "run_info.mode",
    "hardware": "run_info.hardware",
    "sharegpt_normalized_latency": "sharegpt.0.normalized_latency",
    "alpaca_normalized_latency": "alpaca.0.normalized_latency",
}


class CollectSweep(SweepSummary):
    """After a multirun, the generic sweep table (sweep.csv / .md / .png) and every job's
    fig18b.json merged into the sweep directory's figure."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("result", "fig18b.json")
        kwargs.setdefault("columns", SWEEP_COLUMNS)
        kwargs.setdefault("plot", "sharegpt_normalized_latency")
        super().__init__(**kwargs)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the sweep table, then fig18b.json / .csv / .png into the sweep dir."""
        super().on_multirun_end(config, **kwargs)
        sweep_dir = Path(config.hydra.sweep.dir)
        curves: dict[str, list[dict[str, Any]]] = {}
        info: dict[str, Any] = {}
        for path in sorted(sweep_dir.glob("*/fig18b.json")):
            data = json.loads(path.read_text())
            info = data.get("run_info", info)
            for w, pts in data.items():
                if w not in ("paper", "run_info", "config", "seeds") and isinstance(pts, list):
                    curves.setdefault(w, []).extend(pts)
        if not curves:
            return
        cfg = OmegaConf.to_container(config, resolve=False)
        cfg.pop("hydra", None)
        exp = Experiment(cfg, None, _NoLog(), sweep_dir)
        info = {**info, "merged_from": str(sweep_dir)}
        paths = finish(exp, curves, info)
        print(f"fig18b sweep: {', '.join(str(p) for p in paths)}")


class _NoLog:
    """The sweep's own figure is not logged (each job logged its own)."""

    def log_file(self, path: Any) -> None:
        """Do nothing."""


@hydra.main(config_path="../configs", config_name="fig18b", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
