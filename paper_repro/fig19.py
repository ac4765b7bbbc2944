"""Fig. 19: preemption cost by block size: swapping a request's KV out and back in vs
recomputing it (re-prefilling its tokens). Real runs time the engine's own swap copies
(``runner.kv_cache.move_blocks``) and its prefill step; simulated curves price the same work on
the configured GPU. ``python -m paper_repro.fig19 [overrides]``"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from paper_repro.common import Experiment, figure, hydra_output_dir, setup, write_results
from paper_repro.paper_numbers import FIG19_RECOMPUTE_MS, FIG19_SWAP_MS


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def real_point(
    real: Any, exp: Experiment, block_size: int, ctx: int, repeats: int
) -> dict[str, Any]:
    """Time one request's swap out + in, and its re-prefill, on the real engine."""
    import torch

    from paged_llm.runner.kv_cache import move_blocks
    from paged_llm.sampling_params import SamplingParams

    blocks = -(-(ctx + 1) // block_size)
    settings = exp.settings(
        "paged", block_size=block_size, num_gpu_blocks=2 * blocks + 2,
        max_model_len=max(ctx + 2, 2 * block_size), max_num_batched_tokens=max(ctx + 2, 2048),
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(real.num_threads or threads)
    try:
        engine = real.engine("paged", settings)
        runner = engine.runner
        prompt = {"prompt_token_ids": [3 + i % 1000 for i in range(ctx)]}
        counter = iter(range(10**6))

        def recompute() -> None:  # one prefill of ctx tokens: what recomputation re-does
            engine.add_request(
                f"r{next(counter)}", prompt, SamplingParams(temperature=0, max_tokens=1)
            )
            engine.step()

        recompute_ms = _median_ms(recompute, repeats)
        engine.add_request(
            "swap", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        engine.step()
        table = list(engine.scheduler.kv.get_block_table(engine.scheduler.requests["swap"]))
        # A CPU pool shaped like the device pool, as the engine's swap space is.
        cpu = [
            (torch.empty_like(k, device="cpu"), torch.empty_like(v, device="cpu"))
            for k, v in runner.kv_caches
        ]
        out_map = list(zip(table, range(len(table))))
        in_map = [(c, d) for d, c in out_map]

        def swap() -> None:  # the engine's data path for a swap out and the swap back in
            move_blocks(runner.kv_caches, cpu, out_map)
            move_blocks(cpu, runner.kv_caches, in_map)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()

        swap_ms = _median_ms(swap, repeats)
        engine.abort_request("swap")
    finally:
        torch.set_num_threads(threads)
    return {
        "block_size": block_size,
        "swap_in_out_ms": swap_ms,
        "recompute_ms": recompute_ms,
        "blocks": len(table),
    }


def simulated_point(exp: Experiment, block_size: int, ctx: int) -> dict[str, Any]:
    """The same work priced by the cost model: two swaps of the request's blocks vs a prefill."""
    cm = exp.executor.cost_model(block_size)
    blocks = -(-ctx // block_size)
    return {
        "block_size": block_size,
        "swap_in_out_ms": 2000 * cm.swap_time(blocks),
        "recompute_ms": 1000 * cm.prefill_time(ctx),
        "blocks": blocks,
    }


def plot(result: dict[str, Any], title: str) -> Any:
    """Cost vs block size: swap and recompute, real and simulated, with the paper's."""
    panels = [k for k in ("real", "simulated") if result.get(k)]
    fig, axes = figure(ncols=len(panels), width=4.6, height=3.6)
    for ax, key in zip(axes[0], panels):
        pts = result[key]
        xs = [p["block_size"] for p in pts]
        ax.plot(xs, [p["swap_in_out_ms"] for p in pts], "o-", label="swap in + out")
        ax.plot(xs, [p["recompute_ms"] for p in pts], "o-", label="recompute")
        if key == "simulated":
            ax.plot(
                list(FIG19_SWAP_MS),
                list(FIG19_SWAP_MS.values()),
                "s--",
                alpha=0.6,
                label="paper swap",
            )
            ax.axhspan(*FIG19_RECOMPUTE_MS, color="tab:orange", alpha=0.2, label="paper recompute")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("time (ms)")
        ax.set_title(result["labels"][key], fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8, y=-0.02)
    return fig


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Measure (and simulate) every block size; write fig19.json / .csv / .png into ``out_dir``."""
    exp = setup(cfg, out_dir)
    c = exp.cfg
    ctx, repeats = int(c["context_tokens"]), int(c["repeats"])
    sizes = [int(b) for b in c["block_sizes"]]
    result: dict[str, Any] = {"context_tokens": ctx, "labels": {}}
    if c.get("real"):
        real = instantiate(c["real"], _convert_="all")
        result["real"] = [real_point(real, exp, b, ctx, repeats) for b in sizes]
        result["labels"]["real"] = real.describe()
    if c.get("simulate"):
        result["simulated"] = [simulated_point(exp, b, ctx) for b in sizes]
        result["labels"]["simulated"] = exp.executor.describe()
    result["paper"] = {"swap_ms": FIG19_SWAP_MS, "recompute_ms": FIG19_RECOMPUTE_MS}
    info = exp.provenance()
    info["mode"] = "real" if c.get("real") else "simulated"
    info["hardware"] = result["labels"]
    result["run_info"] = info
    rows = [{"mode": k, **p} for k in ("real", "simulated") for p in result.get(k, [])]
    paths = write_results(exp, "fig19", result, rows, plot(result, f"Fig. 19, {ctx}-token request"))
    exp.logger.finish()
    for r in rows:
        swap, rec = r["swap_in_out_ms"], r["recompute_ms"]
        print(
            f"{r['mode']:9s} block {r['block_size']:3d}: swap {swap:.2f} ms, recompute {rec:.2f} ms"
        )
    print(f"fig19: {', '.join(str(p) for p in paths)}")
    return paths


@hydra.main(config_path="../configs", config_name="fig19", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
