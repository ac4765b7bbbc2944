"""Memory saved by sharing, measured on the real engine with a trained model (the real-run
counterpart of paper_repro/fig15.py, whose simulator has no logits and must model which beam
each new beam extends).

Parallel sampling (n = 2/4/6, temperature 1) and beam search (width 2/4/6) on prompts cut from
held-out standard-library source. Lengths are drawn per request from the synthetic Alpaca
distribution the simulated figure uses (log-normal, the paper's means 19.31 / 58.45), or fixed
with ``fixed``; EOS is ignored, so each request runs its drawn output length. After every
engine step the running sequences' block tables are read from the paged KV manager: a shared
block counts once with sharing and once per holder without, weighted by the step's wall time
(``paged_llm.sim.groups.SharingStats``, the same accounting as the simulated figure).

    python -m experiments.beam_sharing [checkpoint=target] [prompts=16] [fixed=[PROMPT,NEW]]
        # configs/beam_sharing.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from experiments.common.cli import hydra_app, settings
from paged_llm.sim.groups import SharingStats

PAPER_ALPACA = {  # Fig. 15, OPT-13B on Alpaca (percent)
    "parallel_2": 6.09, "parallel_4": 8.53, "parallel_6": 9.79,
    "beam_2": 37.56, "beam_4": 53.13, "beam_6": 55.16,
}  # fmt: skip


def running_tables(engine: Any) -> list[list[int]]:
    """Block tables of the sequences the scheduler is running now."""
    sched = engine.scheduler
    return [list(sched.kv.get_block_table(r)) for r in sched.running]


def measure_beam(
    engine: Any, prompts: list[list[int]], width: int, new: list[int], parents: list | None = None
) -> dict:
    """Beam search of ``width`` over ``prompts`` (one call per output length, all together
    in flight would need per-prompt lengths); the sharing along the way. ``parents``, a
    [width][width] count table, collects which rank's beam each new beam of each rank
    extended (steps after the first, when all ``width`` beams are live)."""
    from paged_llm.beam_search import BeamSearchParams, beam_search

    stats, last = SharingStats(), [time.perf_counter()]

    def on_step(eng: Any) -> None:
        now = time.perf_counter()
        stats.add(running_tables(eng), now - last[0])
        last[0] = now

    def on_fork(num_parents: int, child: int, parent: int) -> None:
        if parents is not None and num_parents == width:
            parents[child][parent] += 1

    by_len: dict[int, list[list[int]]] = {}
    for p, n in zip(prompts, new):
        by_len.setdefault(n, []).append(p)
    for n, group in sorted(by_len.items()):
        params = BeamSearchParams(beam_width=width, max_tokens=n, ignore_eos=True)
        beam_search(engine, [{"prompt_token_ids": p} for p in group], params, on_step, on_fork)
        last[0] = time.perf_counter()
    return stats.to_dict()


def measure_parallel(
    engine: Any, prompts: list[list[int]], n: int, new: list[int], seed: int
) -> dict:
    """n samples per prompt at temperature 1; the sharing along the way."""
    from paged_llm import SamplingParams

    for i, (p, m) in enumerate(zip(prompts, new)):
        params = SamplingParams(n=n, temperature=1.0, max_tokens=m, ignore_eos=True, seed=seed + i)
        engine.add_request(f"par-{n}-{i}", {"prompt_token_ids": p}, params)
    stats = SharingStats()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        stats.add(running_tables(engine), time.perf_counter() - start)
    return stats.to_dict()


def request_lengths(num: int, fixed: tuple[int, int] | None, seed: int = 0) -> list[tuple]:
    """(prompt, output) lengths: fixed, or drawn from the synthetic Alpaca distribution."""
    if fixed is not None:
        return [fixed] * num
    from paged_llm.workloads.lengths import synthetic_lengths
    from paged_llm.workloads.traces import ALPACA

    return [(p.input_len, p.output_len) for p in synthetic_lengths(num, seed, ALPACA)]


def run(model: str, num_prompts: int, fixed: tuple[int, int] | None, out: Path) -> dict:
    """Every setting on one engine; write and return beam_sharing.json."""
    from experiments.spec_workload import code_prompts, model_dir
    from paged_llm import LLM
    from paged_llm.metrics.run_info import run_info

    llm = LLM(model_dir(model), block_size=16, seed=0, max_model_len=512, cpu_kv_cache_gib=0.25)
    lengths = request_lengths(num_prompts, fixed)
    pool = code_prompts(model, num_prompts, max(i for i, _ in lengths))
    prompts = [p[:i] for p, (i, _) in zip(pool, lengths)]
    new = [o for _, o in lengths]
    results: dict[str, Any] = {}
    parent_ranks: dict[str, list[list[int]]] = {}
    for k in (2, 4, 6):
        results[f"parallel_{k}"] = measure_parallel(llm.llm_engine, prompts, k, new, seed=k)
        parent_ranks[str(k)] = [[0] * k for _ in range(k)]
        results[f"beam_{k}"] = measure_beam(llm.llm_engine, prompts, k, new, parent_ranks[str(k)])
    for name, r in results.items():
        r["saving_percent"] = 100 * r["saving"] if r["saving"] is not None else None
        r["paper_alpaca_percent"] = PAPER_ALPACA[name]
    doc = {
        "settings": results,
        # width -> [child rank][parent rank] counts: the beam-parent model the simulator can
        # replay (paged_llm/sim/groups.py, beam_parents="measured")
        "parent_ranks": parent_ranks,
        "model": model,
        "prompts": num_prompts,
        "lengths": "fixed" if fixed else "synthetic Alpaca (log-normal, means 19.31 / 58.45)",
        "mean_prompt_len": sum(map(len, prompts)) / len(prompts),
        "mean_new_tokens": sum(new) / len(new),
        "block_size": 16,
        "note": "real engine, built-in trained code model on a CPU; paper: OPT-13B on Alpaca",
        **run_info("real"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "beam_sharing.json").write_text(json.dumps(doc, indent=2))
    for name, r in results.items():
        print(f"{name:11s} saved {r['saving_percent']:5.1f}%   paper (Alpaca) "
              f"{r['paper_alpaca_percent']:5.2f}%")  # fmt: skip
    return doc


def write(cfg: Any, out_dir: str | Path) -> dict:
    """Run it with the config's settings; write beam_sharing.json into out_dir; return it."""
    args = settings(cfg)
    import torch

    torch.set_num_threads(args.threads)
    fixed = tuple(args.fixed) if args.fixed else None
    return run(args.checkpoint, args.prompts, fixed, Path(out_dir))


def main() -> None:
    """``python -m experiments.beam_sharing [key=value ...]`` (configs/beam_sharing.yaml)."""
    hydra_app("beam_sharing", write)


if __name__ == "__main__":
    main()
