"""Capacity planning by simulation: one job prices one deployment (hardware, GPUs, KV policy,
batching limits, precisions) by the highest request rate that meets every SLO on the
configured workload, found by a bracketing search on rate over simulated runs; a multirun
searches the deployments (the basic sweeper's grid, or Optuna) and ranks them by requests per
dollar. ``python -m experiments.capacity_plan -m`` (docs/capacity_planning.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.capacity.deployment import Deployment
from experiments.capacity.evaluate import Prober, RateSearch, bound_rate, capacity
from experiments.capacity.rate_search import SLO
from experiments.capacity.report import RESULT, write_report
from paged_llm.metrics.run_info import run_info
from paged_llm.sim.hardware import get_hardware
from paged_llm.workloads.arrivals import WorkloadSpec, build_workload
from paper_repro.common import _clean, hydra_output_dir, module_command


def seeds_of(spec: Any) -> list[int]:
    """A list of seeds, or a count n for seeds 0..n-1 (as paper_repro's ``seeds``)."""
    return list(range(spec)) if isinstance(spec, int) else [int(s) for s in spec]


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers, without the ``hydra`` node (a sweep's callback sees a
    job's config before Hydra fills in the job's number)."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    return OmegaConf.to_container(OmegaConf.create(plain), resolve=True)


def check(cfg: DictConfig | dict[str, Any]) -> None:
    """Refuse a bad job before any simulation: unknown names, bad SLOs or search settings."""
    c = cfg if isinstance(cfg, dict) else resolved(cfg)
    dep = Deployment(**c["deployment"])
    get_hardware(dep.hardware)  # raises naming the presets
    SLO(**c["slo"])
    RateSearch(**c["rate_search"])
    dep.price_per_hour(c["prices"])
    if not seeds_of(c["seeds"]):
        raise ValueError("seeds: give at least one")


def evaluate(c: dict[str, Any], executor: Any = None) -> dict[str, Any]:
    """One deployment's result (plain dict): its rate bound, price, requests per dollar and
    the probes; ``executor``: a simulated executor to use instead of the deployment's own
    (the CPU check's calibrated one)."""
    dep = Deployment(**c["deployment"])
    search = RateSearch(**c["rate_search"])
    price = dep.price_per_hour(c["prices"])
    ex = executor or dep.executor(c["model_shape"], c["cost"])
    result: dict[str, Any] = {
        "mode": "simulated", "label": dep.label(), "deployment": c["deployment"],
        "model": ex.model.name, "hardware": ex.describe(), "price_per_hour": price,
        "slo": c["slo"], "rate_search": c["rate_search"], "seeds": seeds_of(c["seeds"]),
        "workload": build_workload(WorkloadSpec(**c["workload"])).describe(),
    }  # fmt: skip
    try:
        prober = deployment_prober(c, dep, ex)
    except ValueError as err:  # the model and its activations do not fit these GPUs
        return {**result, "status": f"infeasible: {err}", "requests_per_dollar": 0.0}
    settings, blocks = prober.settings, prober.settings.num_gpu_blocks
    # to replace the best so far a deployment must beat it by the search's resolution: a rate
    # within rel_tol of the best's cannot be told apart from it by these brackets
    needed = None if search.must_beat is None else (
        search.must_beat * price / 3600 * (1 + search.rel_tol))  # fmt: skip
    bound = capacity(prober, search, needed)
    passing = [p for p in bound.points if p.meets and p.rate == bound.rate]
    per_dollar = bound.rate * 3600 / price
    pruned = bound.kind.startswith("pruned")
    return {
        **result, "status": "pruned" if pruned else "ok", "num_kv_blocks": blocks,
        "settings": settings.to_dict(), "must_beat": search.must_beat,
        "bound_per_dollar": bound_rate(prober, search.start) * 3600 / price,
        "busy_bound_share": prober.busy_share(bound.rate) if bound.rate else None,
        "rate": {**bound.to_dict(), "text": bound.text()},
        "at_rate": passing[0].to_dict() if passing else None,
        "requests_per_dollar": per_dollar, "simulator": prober.speed(),
    }  # fmt: skip


def deployment_prober(c: dict[str, Any], dep: Deployment, executor: Any) -> Prober:
    """The prober of a deployment on the configured workload, its KV pool what fits the GPUs
    (ValueError when the model and its activations do not fit them)."""
    settings = dep.settings(c["engine"])
    blocks = executor.num_blocks(settings, executor.cost_model(settings.block_size))
    search = RateSearch(**c["rate_search"])
    return Prober(executor, dep.policy, settings.with_overrides(num_gpu_blocks=blocks),
                  c["workload"], seeds_of(c["seeds"]), SLO(**c["slo"]),
                  search.early_fraction)  # fmt: skip


def upper_bound(cfg: DictConfig | dict[str, Any]) -> float:
    """An upper bound of the job's requests per dollar without simulating (the branch-and-bound
    sweeper's order): ``evaluate.bound_rate`` per dollar; 0 for a deployment that does not
    fit its GPUs."""
    c = cfg if isinstance(cfg, dict) else resolved(cfg)
    dep = Deployment(**c["deployment"])
    try:
        prober = deployment_prober(c, dep, dep.executor(c["model_shape"], c["cost"]))
    except ValueError:
        return 0.0
    rate = bound_rate(prober, RateSearch(**c["rate_search"]).start)
    return rate * 3600 / dep.price_per_hour(c["prices"])


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> float:
    """Evaluate the configured deployment; write capacity_plan.json (and, run alone, its
    one-row table) into ``out_dir``; return requests per dollar (Optuna's objective)."""
    c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    check(c)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logger = instantiate(c.get("logger") or {"_target_": "paged_llm.metrics.loggers.NullLogger"})
    logger.log_config(c)
    result = evaluate(c)
    info = run_info("simulated", hardware=result["hardware"])
    info["command"] = module_command(info["command"])
    result["run_info"] = info
    path = out / RESULT
    path.write_text(json.dumps(_clean({**result, "config": c}), indent=2))
    logger.log({"requests_per_dollar": result["requests_per_dollar"],
                "rate": (result.get("rate") or {}).get("rate", 0.0),
                "price_per_hour": result["price_per_hour"]})  # fmt: skip
    logger.log_file(path)
    if not _in_multirun():  # a sweep writes one table of all its jobs instead
        for p in write_report(out, [json.loads(path.read_text())])[1]:
            logger.log_file(p)
    logger.finish()
    rate = result.get("rate", {}).get("text", "-")
    print(
        f"{result['label']}: {rate} req/s within the SLOs, ${result['price_per_hour']:.2f}/h, "
        f"{result['requests_per_dollar']:.4g} requests per dollar ({result['status']}); {path}"
    )
    return float(result["requests_per_dollar"])


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(config_path="../configs", config_name="capacity_plan", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra entry point; the return value is what the Optuna sweeper maximizes."""
    return run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
