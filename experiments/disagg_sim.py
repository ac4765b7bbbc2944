"""Disaggregated prefill at GPU scale, simulated (DistServe's question): on the same number of
GPUs, how many requests per second can colocated replicas and prefill/decode splits serve while
most requests meet a TTFT and a TPOT target? Every instance is the real scheduler and KV
manager on a simulated GPU (the roofline cost model of paper_repro); a prompt's KV crosses a
link of ``link_gb_per_s`` from a prefill GPU to a decode GPU (paged_llm/sim/disagg.py).

Goodput is the highest rate of the sweep at which at least ``attainment`` of the requests met
both targets, divided by the number of GPUs.

    python -m experiments.disagg_sim [model_name=opt-13b] [gpu=a100-40gb]
        [workload_path=TRACE.csv] [duration=300] [rates=[1,2,3,...]]
        [layouts=[colocated:4,disaggregated:1:3,disaggregated:2:2]] [ttft_slo=0.25]
        [tpot_slo=0.1]    # configs/disagg_sim.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.common.cli import hydra_app, settings
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.metrics.serving import percentile
from paged_llm.sim.disagg import simulate
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import build_workload


def parse_layout(text: str) -> tuple[str, int, int]:
    """'colocated:N' (N replicas) or 'disaggregated:P:D' -> (layout, prefill GPUs, decode
    GPUs); a colocated N is split as (N - 1, 1) only to carry the count."""
    parts = text.split(":")
    if parts[0] == "colocated" and len(parts) == 2 and int(parts[1]) >= 2:
        return "colocated", int(parts[1]) - 1, 1
    if parts[0] == "disaggregated" and len(parts) == 3:
        return "disaggregated", int(parts[1]), int(parts[2])
    raise ValueError(f"bad layout '{text}': use colocated:N (N >= 2) or disaggregated:P:D")


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Sweep rates for each layout with the config's settings; write disagg_sim.json into
    out_dir; return it."""
    args = settings(cfg)
    layouts = [parse_layout(t) for t in args.layouts]
    executor = SimulatedExecutor(args.gpu, args.model_name)
    serving = ServingSettings()
    colocated = serving.with_overrides(enable_chunked_prefill=args.chunked_prefill)
    rows, summary = [], {}
    for text, (layout, num_p, num_d) in zip(args.layouts, layouts):
        best = 0.0
        for rate in args.rates:
            wl = build_workload({"path": args.workload_path, "request_rate": rate,
                                 "duration_s": args.duration, "seed": args.seed,
                                 "min_input_len": args.min_input_len})  # fmt: skip
            run = simulate(wl, executor, colocated if layout == "colocated" else serving,
                           layout, num_p, num_d, link_gb_per_s=args.link_gb_per_s)  # fmt: skip
            met = run.slo_attainment(args.ttft_slo, args.tpot_slo)
            if met >= args.attainment:
                best = max(best, rate)
            rows.append({
                "layout": text, "rate": rate, "gpus": run.num_gpus, "slo_attainment": met,
                "mean_ttft_s": sum(run.ttft_s) / len(run.ttft_s),
                "p90_ttft_s": percentile(run.ttft_s, 90),
                "mean_tpot_s": sum(run.tpot_s) / len(run.tpot_s),
                "p90_tpot_s": percentile(run.tpot_s, 90),
                "busy": run.busy, "preemptions": run.preemptions,
                "mean_transfer_s": sum(run.transfer_s) / max(1, len(run.transfer_s)),
                "blocks_transferred": run.loaded_blocks,
            })  # fmt: skip
            busy = ", ".join(f"{k} {v:.0%}" for k, v in run.busy.items())
            print(f"{text:>20} {rate:5.2f} req/s: SLO attainment {met:5.1%}, TTFT p90 "
                  f"{rows[-1]['p90_ttft_s']:.3f} s, TPOT p90 {rows[-1]['p90_tpot_s']:.3f} s, "
                  f"busy {busy}", flush=True)  # fmt: skip
        gpus = num_p + num_d
        summary[text] = {"gpus": gpus, "goodput_req_s": best, "goodput_per_gpu": best / gpus}
        print(f"{text:>20}: goodput {best:g} req/s on {gpus} GPUs ({best / gpus:.2f} per GPU)")
    doc = {
        **run_info("simulated", hardware=f"{executor.describe()} per instance"),
        "settings": {**vars(args), "serving": serving.to_dict()},
        "goodput": summary,
        "runs": rows,
        "notes": "goodput = the highest swept rate with at least the attainment share of "
        "requests meeting both SLOs; requests dealt round-robin to replicas / prefill GPUs "
        "/ decode GPUs; the KV transfer is bytes / link bandwidth + 1 ms and does not slow "
        "either GPU",
    }
    print(f"wrote {write_json(out_dir, 'disagg_sim.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.disagg_sim [key=value ...]`` (configs/disagg_sim.yaml)."""
    hydra_app("disagg_sim", write)


if __name__ == "__main__":
    main()
