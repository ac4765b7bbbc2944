"""Check a capacity plan's answer on the real engine of this machine: calibrate the simulator
for this device (paper_repro.validate_sim's measurement and fit), search a small space of
deployments in simulation, run the recommended deployment on the real engine at its
recommended rate, and compare the sustained rate and SLO attainment with validate_sim's
tolerances. ``python -m experiments.capacity.check`` (config ``capacity_check``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.capacity.deployment import Deployment
from experiments.capacity.rate_search import SLO, judge
from experiments.capacity.report import ranked, write_report
from experiments.capacity.space import apply, grid
from experiments.capacity_plan import evaluate
from paged_llm.metrics.loggers import NullLogger
from paged_llm.metrics.serving import serving_metrics
from paged_llm.workloads.arrivals import WorkloadSpec, build_workload
from paper_repro.common import Experiment, hydra_output_dir, write_results
from paper_repro.validation.compare import Check, table
from paper_repro.validation.device_calibration import calibrate_here, fit_quality


def quantities(trace: Any, rate: float, slo: SLO) -> dict[str, float]:
    """What the check compares (sustained rate, SLO attainment) and shows (the percentiles)."""
    point = judge([trace], rate, slo)
    return {"sustained_rate": serving_metrics(trace)["request_throughput"],
            "slo_attainment": point.attainment, "ttft_ms": point.ttft_ms,
            "tpot_ms": point.tpot_ms, "meets_slo": point.meets}  # fmt: skip


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Calibrate, plan, run the recommendation for real; write capacity_check.json / .csv /
    .png and the plan's table (capacity_plan.{csv,md}, capacity_plan_pareto.png)."""
    c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    real_exp, data, probe, sim = calibrate_here(c, out)
    real = real_exp.executor
    fit = fit_quality(sim, data)
    # the plan: every deployment of the space, simulated on this device's calibrated law
    results = [evaluate(apply(c, job), executor=sim) for job in grid(c["space"])]
    rows, plan_paths = write_report(out, results)
    best = next(r for r in results if r["label"] == rows[0]["deployment"])
    dep, slo = Deployment(**best["deployment"]), SLO(**c["slo"])
    rate = best["rate"]["rate"]
    if best["rate"]["kind"] != "exact":
        raise RuntimeError(f"the recommendation's rate is a bound ({best['rate']['text']}); "
                           "widen rate_search's floor / ceiling")  # fmt: skip
    # the recommendation, real and simulated (at the speed probed around the real run)
    workload = build_workload(WorkloadSpec(**{**c["workload"], "seed": c["seeds"][0],
                                              "request_rate": rate}))  # fmt: skip
    settings = dep.settings(c["engine"])
    before = probe.time()
    real_trace = real_exp.run(workload, dep.policy, settings, memory_every=0)
    speed = probe.drift(before, probe.time())
    pool = settings.with_overrides(num_gpu_blocks=real_trace.num_kv_blocks)
    as_calibrated = quantities(sim.run(workload, dep.policy, pool, memory_every=0), rate, slo)
    with sim.at_speed(speed):
        sim_trace = sim.run(workload, dep.policy, pool, memory_every=0)
    real_q, sim_q = quantities(real_trace, rate, slo), quantities(sim_trace, rate, slo)
    checks = []
    for name, spec in c["checks"].items():
        if name in real_q:
            judged = Check(**spec).judge(real_q[name], sim_q[name])
            checks.append({"figure": "plan", "quantity": name, "policy": dep.policy,
                           "real": real_q[name], "simulated": sim_q[name], **judged})  # fmt: skip
    passed = sum(r["pass"] for r in checks)
    result = {
        "what": {"real": f"measured: {real.describe()}, {data['clock']} clock",
                 "simulated": f"{sim.describe()}, calibrated by calibration.json, at the "
                              f"speed probed around the real run ({speed:.3f})"},
        "recommended": {"deployment": best["deployment"], "label": best["label"],
                        "rate": best["rate"]["text"], "rate_req_s": rate},
        "summary": {"passed": passed, "total": len(checks), "all_pass": passed == len(checks)},
        "comparison": checks, "real": real_q, "simulated": sim_q,
        "as_calibrated": as_calibrated, "speed": speed, "slo": c["slo"],
        "plan": [{k: r[k] for k in ("rank", "deployment", "rate", "requests_per_dollar")}
                 for r in ranked(results)],
        "calibration": {"clock": data["clock"], "fit": {k: fit[k] for k in
                        ("law", "mean_abs_relative_error", "max_abs_relative_error")}},
        "run_info": {"real": real_exp.provenance([workload]),
                     "simulated": Experiment(c, sim, NullLogger(), out).provenance([workload])},
    }  # fmt: skip
    paths = write_results(real_exp, "capacity_check", result, checks, None)
    print(f"recommended: {best['label']} at {rate:.3g} req/s (simulated, {data['clock']} clock)")
    print(table(checks))
    print(f"real P{slo.ttft_percentile:g} TTFT {real_q['ttft_ms']:.0f} ms / P"
          f"{slo.tpot_percentile:g} TPOT {real_q['tpot_ms']:.1f} ms (simulated "
          f"{sim_q['ttft_ms']:.0f} / {sim_q['tpot_ms']:.1f}; as calibrated "
          f"{as_calibrated['ttft_ms']:.0f} / {as_calibrated['tpot_ms']:.1f}); meets the SLOs: "
          f"real {real_q['meets_slo']}, simulated {sim_q['meets_slo']}, as calibrated "
          f"{as_calibrated['meets_slo']}")  # fmt: skip
    print(f"{passed} of {len(checks)} within tolerance; "
          f"{', '.join(str(p) for p in [*paths, *plan_paths])}")  # fmt: skip
    return result


@hydra.main(config_path="../../configs", config_name="capacity_check", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
