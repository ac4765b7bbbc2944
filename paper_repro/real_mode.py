"""What a figure needs to run on the real engine at any scale, applied to its resolved config
before it runs (``common.setup``); a config without these keys is left as it is.

* ``kv_budget_of: a100-40gb`` sizes the KV pool (``engine.num_gpu_blocks``) to what that GPU
  would hold for the run's model (``paged_llm/sim/kv_budget.py``), so a bigger GPU runs in the
  paper's memory-bound regime.
* ``run_policies: [paged, orca_oracle]`` keeps only those policies.
* ``budget_s: 360`` sizes every run (the workloads' duration, the averaging windows and the
  stop time) so that the figure's runs fit the budget together.
* ``probe:`` runs a short overloaded burst per (workload, policy) and reads the configured
  request rates as fractions of the capacity it measured, so the same command loads a 3090, an
  A100 or an H200 (or this CPU) alike.

What was applied is written into the config (``kv_budget``, ``probe.capacity``) and so into
every result's JSON.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from paged_llm.sim.kv_budget import kv_budget
from paged_llm.sim.settings import ServingSettings
from paper_repro.seeds import seed_list

log = logging.getLogger("paper_repro")
WARMUP_SHARE = 1 / 3  # a budgeted run averages over its last two thirds (the artifact: 300-900 s)


def prepare_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``cfg`` with the policy filter, the KV budget and the time budget applied."""
    cfg = keep_policies(copy.deepcopy(cfg))
    if cfg.get("kv_budget_of"):
        budget = budget_for(cfg)
        cfg["engine"]["num_gpu_blocks"] = budget.num_blocks
        cfg["kv_budget"] = budget.to_dict()
    if cfg.get("budget_s"):
        apply_time_budget(cfg)
    return cfg


def keep_policies(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with only the policies of ``run_policies`` (all when it is unset), in place."""
    keep = cfg.get("run_policies")
    if keep:
        unknown = sorted(set(keep) - set(cfg.get("policies") or {}))
        if unknown:
            raise ValueError(f"run_policies {unknown} are not policies of this figure")
        cfg["policies"] = {p: v for p, v in cfg["policies"].items() if p in keep}
        if "rates" in cfg:
            cfg["rates"] = {p: v for p, v in cfg["rates"].items() if p in keep}
    return cfg


def budget_for(cfg: dict[str, Any]) -> Any:
    """The KV budget of ``kv_budget_of`` for the real run's model, at the engine settings every
    policy shares (one pool for all, as in the artifact)."""
    from paged_llm.distributed.checks import model_hf_config

    model = cfg["executor"]["model"]["model"]
    settings = ServingSettings(**{**cfg["engine"], "num_gpu_blocks": None})
    return kv_budget(cfg["kv_budget_of"], model_hf_config(model), settings, str(model))


def probe_runs(cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None, str]]:
    """The capacity probes a figure makes, once before its seeds: (workload name, its spec or
    None for ``workload``, policy). Fig. 12 probes each policy (its rates are fractions of each
    one's capacity); Fig. 2 and Fig. 13 the reference policy on each workload."""
    if not cfg.get("probe"):
        return []
    ref = cfg["probe"].get("reference_policy", "paged")
    name = cfg["workload"].get("name", "workload")
    if "rates" in cfg:  # Fig. 12
        return [(name, None, p) for p in cfg["rates"]]
    if cfg.get("workloads"):  # Fig. 13
        return [(w, spec, ref) for w, spec in cfg["workloads"].items()]
    return [(name, None, ref)]  # Fig. 2


def num_runs(cfg: dict[str, Any]) -> int:
    """How many engine runs the figure makes: its measurements once per seed, then the probes
    (which run once)."""
    if "rates" in cfg:  # Fig. 12: one run per (policy, rate)
        per_seed = sum(len(r) for p, r in cfg["rates"].items() if p in cfg["policies"])
    else:  # Fig. 2 / 13: one run per (workload, policy)
        per_seed = (len(cfg.get("workloads") or {}) or 1) * len(cfg["policies"])
    return per_seed * len(seed_list(cfg)) + len(probe_runs(cfg))


def apply_time_budget(cfg: dict[str, Any]) -> None:
    """Give every run an equal share of ``budget_s``: its arrivals span the share less a drain
    margin, the averaging window is the span after a warm-up third, and runs stop at its end."""
    span = 0.9 * float(cfg["budget_s"]) / num_runs(cfg)  # the rest: start-up, the last step
    window = [span * WARMUP_SHARE, span]
    for spec in [cfg["workload"], *(cfg.get("workloads") or {}).values()]:
        spec.update(duration_s=span, num_requests=None)
    cfg["window"] = window
    if "windows" in cfg:
        cfg["windows"] = {w: list(window) for w in cfg["windows"]}
    cfg["stop_time_s"] = span
    if cfg.get("probe"):
        cfg["probe"]["max_s"] = span


def probe_capacity(exp: Any, base: dict[str, Any] | None, policy: str) -> float:
    """Requests per second ``policy`` completes at full load: a burst of ``probe.num_requests``
    requests all arriving at once (stopped at ``probe.max_s``), counted while some still wait."""
    probe = exp.cfg["probe"]
    workload = exp.workload(
        base=base, request_rate=float("inf"), duration_s=None,
        num_requests=int(probe["num_requests"]),
    )  # fmt: skip
    trace = exp.run(workload, policy, exp.settings(policy), memory_every=0,
                    stop_time=probe.get("max_s"))  # fmt: skip
    return saturated_throughput(trace)


def saturated_throughput(trace: Any) -> float:
    """Completions per second up to the last step that left requests waiting: the engine ran
    at its capacity until then, while a burst's drain (the last requests finishing alone)
    would understate it. A burst that fit at once (no step left any waiting) is counted whole."""
    waited = [i.time + i.duration for i in trace.iterations if i.num_waiting > 0]
    until = waited[-1] if waited else trace.end_time
    done = sum(r.finished and r.finished_time <= until for r in trace.requests)
    if not done:
        raise ValueError(
            f"the capacity probe of {trace.policy} completed no request in {until:.1f} s; "
            "raise probe.max_s or probe.num_requests"
        )
    return done / until


def apply_probe(exp: Any) -> None:
    """Turn the configured rates (fractions of capacity) into request rates: Fig. 12's per
    policy of that policy's capacity, Fig. 2's and Fig. 13's of the reference policy's on each
    workload. The capacities and the fractions are kept in ``probe``."""
    c = exp.cfg
    probe = c["probe"]
    capacity: dict[str, dict[str, float]] = {}
    for name, spec, policy in probe_runs(c):
        capacity.setdefault(name, {})[policy] = probe_capacity(exp, spec, policy)
    ref = probe.get("reference_policy", "paged")
    name = c["workload"].get("name", "workload")
    if "rates" in c:  # Fig. 12: each policy's fractions of its own capacity
        probe["fractions"] = copy.deepcopy(c["rates"])
        c["rates"] = {p: [f * capacity[name][p] for f in fr] for p, fr in c["rates"].items()}
    elif c.get("workloads"):  # Fig. 13: each workload at its own fraction of capacity
        probe["fractions"] = {w: s["request_rate"] for w, s in c["workloads"].items()}
        for w, spec in c["workloads"].items():
            spec["request_rate"] *= capacity[w][ref]
    else:  # Fig. 2
        probe["fractions"] = c["workload"]["request_rate"]
        c["workload"]["request_rate"] *= capacity[name][ref]
    probe["capacity"] = capacity
    log.info("capacity probe (req/s): %s", capacity)
