"""Fig. 14: normalized latency vs request rate with parallel sampling (n = 2, 4, 6) and beam
search (width 2, 4, 6), the paged policy against the Orca variants, and the highest rate each
sustains. ``python -m paper_repro.fig14 [overrides]`` (simulated OPT-13B on an A100-40GB,
Alpaca lengths; ``--config-name fig14_quick`` for a CI-sized run, ``--config-name fig14_real``
for the real engine with the tiny model on this machine).

The sweep machinery here (settings x policies x rates) is shared by Fig. 16 and Fig. 17."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from paged_llm.core.kv import POLICIES
from paged_llm.metrics.serving import mean_batched_requests, serving_metrics
from paged_llm.utils.registry import resolve
from paper_repro.common import Experiment, hydra_output_dir, setup, write_results
from paper_repro.fig12 import SUSTAINED_RATE
from paper_repro.paper_numbers import FIG14_GAIN_OVER_ORACLE
from paper_repro.seeds import error_bars, over_seeds
from paper_repro.verdicts import (
    LOWER_BOUND,
    MEASURED,
    bounds,
    check,
    merged_kind,
    rate_kind,
    sustained_text,
)

ORDER = ("paged", "orca_oracle", "orca_pow2", "orca_max")  # the paper's ordering


def sweep(
    exp: Experiment, spec: dict[str, Any], policy: str, rates: list[float]
) -> list[dict[str, Any]]:
    """One run per request rate of the workload ``spec``; each point has the rate, normalized
    latency, throughput, preemptions and (sharing policies) the memory saved by sharing."""
    points = []
    for rate in rates:
        workload = exp.workload(base=spec, request_rate=float(rate))
        trace = exp.run(workload, policy, exp.settings(policy), memory_every=0)
        m = serving_metrics(trace)
        sharing = trace.extra.get("sharing") or {}
        points.append(
            {
                "request_rate": float(rate),
                "normalized_latency": m["normalized_latency"],
                "request_throughput": m["request_throughput"],
                "completed": m["completed"],
                "num_requests": len(workload.requests),
                "num_preemptions": m["num_preemptions"],
                "mean_batched_sequences": mean_batched_requests(trace.iterations),
                "sharing_saving": sharing.get("saving"),
                "prefix_cache_hit_rate": trace.extra.get("prefix_cache_hit_rate"),
                "cpu_time_s": trace.extra.get("cpu_time_s"),  # real runs: the engine's CPU time
            }
        )
    return points


def run_key(policy: str, settings: Any, spec: dict[str, Any], rates: list[float]) -> str:
    """What a sweep runs. A policy that cannot share runs beam search of width w exactly as w
    parallel samples (independent sequences), so those sweeps are made once."""
    spec = dict(spec)
    if not resolve("policy", policy, POLICIES).supports_sharing:
        width = max(int(spec.get("n", 1)), int(spec.get("beam_width", 1)))
        spec.update(n=width, beam_width=1)
        spec.pop("beam_parents", None)
    return json.dumps([policy, settings.to_dict(), spec, list(rates)], sort_keys=True)


def ordering_ok(result: dict[str, Any]) -> bool:
    """Paged >= Oracle >= Pow2 >= Max in sustained rate (for the policies present)."""
    rates = [result[p]["max_sustained_rate"] for p in ORDER if p in result]
    return all(a >= b for a, b in zip(rates, rates[1:]))


def sustained_rate_reader(cfg: dict[str, Any]) -> Any:
    """How the highest sustained rate is read off a sweep (config ``sustained_rate_from``, as
    Fig. 12): the latency-threshold crossing by default."""
    how = cfg.get("sustained_rate_from", "latency_threshold")
    if how not in SUSTAINED_RATE:
        raise ValueError(f"sustained_rate_from must be one of {list(SUSTAINED_RATE)}, got '{how}'")
    return SUSTAINED_RATE[how]


def run_settings(
    exp: Experiment, threshold: float
) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """Sweep every configured setting (workload overrides) x policy x rate. Returns the result
    per setting (points, sustained rates, paged / other ratios), CSV rows and the workloads."""
    c = exp.cfg
    sustained_rate = sustained_rate_reader(c)
    by_threshold = c.get("sustained_rate_from", "latency_threshold") == "latency_threshold"
    result: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    used = []
    done: dict[str, list[dict[str, Any]]] = {}  # runs already made, by what they ran
    for name, overrides in c["settings"].items():
        if overrides is None:  # a setting switched off (e.g. settings.beam_4=null)
            continue
        spec = {**c["workload"], **overrides}
        used.append(exp.workload(base=spec, request_rate=1.0))
        res: dict[str, Any] = {"workload": dict(overrides)}
        for policy in c["policies"]:
            rates = (c["rates"].get(name) or {}).get(policy)
            if not rates:
                continue
            key = run_key(policy, exp.settings(policy), spec, rates)
            if key not in done:
                done[key] = sweep(exp, spec, policy, list(rates))
            points = done[key]
            sustained = sustained_rate(points, threshold)
            crossing = [(q["request_rate"], q["normalized_latency"]) for q in points]
            kind = rate_kind(crossing, threshold) if by_threshold else MEASURED
            res[policy] = {
                "points": points,
                "max_sustained_rate": sustained,
                "sustained_rate_kind": kind,  # a crossing outside the grid is a bound
            }
            rows += [{"setting": name, "policy": policy, **q} for q in points]
            exp.logger.log({f"{name}/{policy}/max_sustained_rate": sustained})
        base = res.get("paged", {}).get("max_sustained_rate")
        res["ratios_vs_paged"] = {
            p: (base / r["max_sustained_rate"] if r["max_sustained_rate"] else math.inf)
            for p, r in res.items()
            if p in ORDER and p != "paged" and base is not None
        }
        res["ordering_ok"] = ordering_ok(res)
        result[name] = res
    return result, rows, used


def measure_settings(exp: Experiment) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """One seed of :func:`run_settings` at the configured latency threshold."""
    return run_settings(exp, float(exp.cfg["latency_threshold_s"]))


def settings_over_seeds(exp: Experiment) -> tuple[dict[str, Any], list[dict[str, Any]], list]:
    """:func:`run_settings` once per seed: mean rates and gains with their intervals; each
    setting's ordering is read off the mean rates (Fig. 14, 16 and 17)."""
    result, rows, used = over_seeds(exp, measure_settings)
    for res in result.values():
        if isinstance(res, dict) and "ordering_ok" in res:
            res["ordering_ok"] = ordering_ok(res)
            for p in ORDER:  # a bound on any seed makes the mean a bound
                if p in res:
                    res[p]["sustained_rate_kind"] = merged_kind(res[p]["sustained_rate_kind"])
    return result, rows, used


def sustained_capped(res: dict[str, Any], policy: str) -> bool:
    """True when the policy never crossed the threshold (its sustained rate is a lower bound)."""
    return res[policy].get("sustained_rate_kind", MEASURED) == LOWER_BOUND


def acceptance(result: dict[str, Any], settings: list[str]) -> dict[str, dict[str, Any]]:
    """The paper's ordering (paged >= Oracle >= Pow2 >= Max) in every setting; undetermined
    where a sustained rate is a bound of the rate grid."""
    target = "paged >= orca_oracle >= orca_pow2 >= orca_max"
    out = {}
    for s in settings:
        ok, b = result[s]["ordering_ok"], bounds(result[s], ORDER)
        extra = {"why": f"sustained rate is a bound ({b}); widen the grid"} if b else {}
        out[f"{s}_ordering"] = check(ok, target, target, ok, not b, **extra)
    return out


def plot(result: dict[str, Any], settings: list[str], threshold: float, title: str) -> Any:
    """Normalized latency vs rate, one panel per setting (three per row), a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, len(settings))
    nrows = -(-len(settings) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(settings) :]:
        ax.set_visible(False)
    for ax, s in zip(axes.flat, settings):
        res = result[s]
        for p in [q for q in ORDER if q in res]:
            pts = res[p]["points"]
            xs = [q["request_rate"] for q in pts]
            ys = [q["normalized_latency"] for q in pts]
            paths = [f"{s}/{p}/points/{i}/normalized_latency" for i in range(len(pts))]
            label = f"{p} ({sustained_text(res[p])})"
            yerr = error_bars(result, paths)
            ax.errorbar(xs, ys, yerr=yerr, marker="o", ms=3, capsize=2, label=label)
        ax.axhline(threshold, color="gray", ls="--", lw=0.8)
        ax.set_ylim(0, 4 * threshold)
        ax.set_title(s.replace("_", " "), fontsize=9)
        ax.set_xlabel("request rate (req/s)", fontsize=8)
        ax.set_ylabel("normalized latency (s/token)", fontsize=8)
        ax.legend(fontsize=7, title="policy (sustained req/s)", title_fontsize=7)
    fig.suptitle(title, fontsize=8, y=-0.01)
    fig.tight_layout()
    return fig


def print_summary(result: dict[str, Any], settings: list[str], paper: dict[str, float]) -> None:
    """Sustained rates and the paged policy's gains, with the paper's where it gives one."""
    for s in settings:
        res = result[s]
        rates = ", ".join(f"{p} {sustained_text(res[p])}" for p in ORDER if p in res)
        gains = ", ".join(f"/{p} {r:.2f}x" for p, r in res["ratios_vs_paged"].items())
        ref = f" (paper vs oracle {paper[s]:g}x)" if s in paper else ""
        print(f"{s:11s} sustained req/s: {rates}; paged {gains}{ref}")


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Sweep every setting and policy; write fig14.json / .csv / .png into ``out_dir``."""
    exp = setup(cfg, out_dir)
    c = exp.cfg
    threshold = float(c["latency_threshold_s"])
    result, rows, used = settings_over_seeds(exp)
    settings = [s for s, res in result.items() if isinstance(res, dict) and "ordering_ok" in res]
    result["acceptance"] = acceptance(result, settings)  # on the means
    result["latency_threshold_s"] = threshold
    result["sustained_rate_from"] = c.get("sustained_rate_from", "latency_threshold")
    result["paper"] = {"gain_over_orca_oracle": FIG14_GAIN_OVER_ORACLE}
    result["run_info"] = exp.provenance(used)
    title = f"Fig. 14, {exp.label(used[:1])}, threshold {threshold:g} s/token"
    paths = write_results(exp, "fig14", result, rows, plot(result, settings, threshold, title))
    exp.logger.finish()
    print_summary(result, settings, FIG14_GAIN_OVER_ORACLE)
    print(f"fig14 ({exp.executor.describe()}): {', '.join(str(p) for p in paths)}")
    return paths


@hydra.main(config_path="../configs", config_name="fig14", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
