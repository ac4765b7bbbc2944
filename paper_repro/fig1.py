"""Fig. 1 (right): KV + weight memory and decode throughput vs batch size, for the paged policy
and a contiguous max-length reservation. ``python -m paper_repro.fig1 [overrides]``"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from paper_repro.common import Experiment, figure, hydra_output_dir, setup, write_results
from paper_repro.paper_numbers import FIG1_MEMORY_GB, FIG1_THROUGHPUT
from paper_repro.seeds import error_bars, over_seeds


def point(exp: Experiment, policy: str, batch: int) -> dict[str, Any]:
    """An offline run with ``batch`` concurrent requests and a pool too big to limit them."""
    c = exp.cfg
    max_len = int(c["engine"]["max_model_len"])
    bs = int(c["engine"]["block_size"])
    blocks = batch * (-(-max_len // bs)) + 16  # every request could reserve max_model_len
    settings = exp.settings(policy, max_num_seqs=batch, num_gpu_blocks=blocks)
    workload = exp.workload(
        request_rate=float("inf"), num_requests=batch * int(c["requests_per_slot"])
    )
    trace = exp.run(workload, policy, settings, memory_every=int(c.get("memory_every", 1)))
    full = [it for it in trace.iterations if it.num_running == batch]  # steady state
    if not full:
        raise ValueError(f"batch {batch} never filled; raise requests_per_slot")
    with_mem = [it for it in full if it.memory is not None]
    used_slots = sum(it.memory.total - it.memory.external_fragmentation for it in with_mem)
    used_slots /= max(1, len(with_mem))
    kv_gb = used_slots * exp.executor.model.kv_bytes_per_token / 1e9
    weights_gb = exp.executor.model.weight_bytes / 1e9
    # With every request scheduled each step and no chunking, each step samples one token each.
    throughput = sum(it.num_running for it in full) / sum(it.duration for it in full)
    return {
        "batch_size": batch,
        "memory_gb": weights_gb + kv_gb,
        "kv_memory_gb": kv_gb,
        "throughput_tokens_per_s": throughput,
    }


def max_batch(points: list[dict[str, Any]], capacity_gb: float) -> float:
    """Batch size at which memory reaches ``capacity_gb`` (linear interpolation)."""
    best = 0.0
    for a, b in zip(points, points[1:]):
        if a["memory_gb"] <= capacity_gb < b["memory_gb"]:
            f = (capacity_gb - a["memory_gb"]) / (b["memory_gb"] - a["memory_gb"])
            return a["batch_size"] + f * (b["batch_size"] - a["batch_size"])
        if b["memory_gb"] <= capacity_gb:
            best = b["batch_size"]
    return best


def plot(result: dict[str, Any], policies: list[str], capacity_gb: float, title: str) -> Any:
    """Memory (left) and throughput (right) vs batch size."""
    fig, axes = figure(ncols=2, width=4.8, height=3.6)
    mem, thr = axes[0]
    for p in policies:
        pts = result[p]
        xs = [q["batch_size"] for q in pts]
        idx = range(len(pts))
        mem_err = error_bars(result, [f"{p}/{i}/memory_gb" for i in idx])
        thr_err = error_bars(result, [f"{p}/{i}/throughput_tokens_per_s" for i in idx])
        mem.errorbar(xs, [q["memory_gb"] for q in pts], yerr=mem_err, fmt="o-", capsize=2, label=p)
        ys = [q["throughput_tokens_per_s"] for q in pts]
        thr.errorbar(xs, ys, yerr=thr_err, fmt="o-", capsize=2, label=f"{p} (ours)")
    mem.axhline(capacity_gb, color="gray", ls="--", lw=0.8, label=f"{capacity_gb:.1f} GB usable")
    mem.set_xlabel("batch size (requests)")
    mem.set_ylabel("memory: weights + KV (GB)")
    mem.legend(fontsize=8)
    thr.plot(
        list(FIG1_THROUGHPUT),
        list(FIG1_THROUGHPUT.values()),
        "s--",
        alpha=0.6,
        label="paper (vLLM)",
    )
    thr.set_xlabel("batch size (requests)")
    thr.set_ylabel("throughput (tokens/s)")
    thr.legend(fontsize=8)
    fig.suptitle(title, fontsize=8, y=-0.02)
    return fig


def measure(
    exp: Experiment, policies: list[str], capacity_gb: float
) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """One seed: every batch size for each policy, and the batch that fits the GPU."""
    result: dict[str, Any] = {}
    rows = []
    for p in policies:
        result[p] = [point(exp, p, int(b)) for b in exp.cfg["batch_sizes"]]
        rows += [{"policy": p, **q} for q in result[p]]
    result["max_batch_in_memory"] = {p: max_batch(result[p], capacity_gb) for p in policies}
    return result, rows, [exp.workload(request_rate=float("inf"), num_requests=1)]


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Sweep batch sizes for each policy; write fig1.json / .csv / .png into ``out_dir``."""
    exp = setup(cfg, out_dir)
    c = exp.cfg
    policies = [p for p, v in c["policies"].items() if v is not None]
    # What the engine may use: gpu_memory_utilization of the device (0.9 leaves 38.7 of 42.9 GB).
    util = float(c["engine"]["gpu_memory_utilization"])
    capacity_gb = util * exp.executor.hardware.memory_bytes * exp.executor.num_gpus / 1e9
    result, rows, used = over_seeds(exp, lambda e: measure(e, policies, capacity_gb))
    result["gpu_memory_gb"] = capacity_gb
    result["paper"] = {"throughput_tokens_per_s": FIG1_THROUGHPUT, "memory": FIG1_MEMORY_GB}
    result["run_info"] = exp.provenance(used)
    title = f"Fig. 1 (right), {exp.label(used[:1])}, mean of {result['seeds']['n']} seed(s)"
    paths = write_results(exp, "fig1", result, rows, plot(result, policies, capacity_gb, title))
    exp.logger.finish()
    for p in policies:
        text = ", ".join(
            f"{q['batch_size']}: {q['throughput_tokens_per_s']:.0f}" for q in result[p]
        )
        print(
            f"{p}: fits {result['max_batch_in_memory'][p]:.1f} requests; tokens/s by batch {text}"
        )
    print(f"fig1 ({exp.executor.describe()}): {', '.join(str(p) for p in paths)}")
    return paths


@hydra.main(config_path="../configs", config_name="fig1", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
