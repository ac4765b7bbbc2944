"""Fig. 2: how each policy uses the KV pool (token states, reservation, internal and external
fragmentation), averaged over the artifact's window. ``python -m paper_repro.fig2 [overrides]``"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from paged_llm.metrics.serving import SHARE_KEYS, mean_batched_requests, memory_shares
from paper_repro.common import Experiment, figure, hydra_output_dir, setup, write_results
from paper_repro.paper_numbers import FIG2, FIG2_PAGED_MIN, FIG2_TOLERANCE_PP
from paper_repro.seeds import error_bars, over_seeds, stat
from paper_repro.verdicts import check

LABELS = {
    "token_states": "token states",
    "reservation": "reservation",
    "internal_fragmentation": "internal frag.",
    "external_fragmentation": "external frag. & other",
}
COLORS = ("tab:green", "tab:orange", "tab:red", "tab:gray")


def artifact_presentation(shares: dict[str, float], free: float) -> dict[str, float]:
    """The paged bar as the artifact drew it: free pool split equally between 'reservation' and
    'internal', allocated-but-unfilled slots shown as 'external & other'."""
    return {
        "token_states": shares["token_states"],
        "reservation": free / 2,
        "internal_fragmentation": free / 2,
        "external_fragmentation": shares["internal_fragmentation"],
    }


def acceptance(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's checks: paged >= 95% token states; each Orca within 6 pp of the paper."""
    paged = result["paged"]["token_states"]
    checks = {
        "paged_token_states": check(
            paged, FIG2["paged"]["token_states"], f">= {FIG2_PAGED_MIN}", paged >= FIG2_PAGED_MIN
        )
    }
    for policy in ("orca_max", "orca_pow2", "orca_oracle"):
        if policy in result:
            ours, paper = result[policy]["token_states"], FIG2[policy]["token_states"]
            checks[f"{policy}_token_states"] = check(
                ours, paper, f"{paper} +- {FIG2_TOLERANCE_PP / 100}",
                abs(ours - paper) * 100 <= FIG2_TOLERANCE_PP,
            )  # fmt: skip
    return checks


def plot(exp: Experiment, result: dict[str, Any], title: str) -> Any:
    """Stacked bars, ours beside the paper's, per policy."""
    fig, axes = figure(width=8.0, height=4.0)
    ax = axes[0][0]
    policies = [p for p in FIG2 if p in result]
    names, bars = [], []
    for p in policies:
        names += [f"{p}\n(ours)", f"{p}\n(paper)"]
        bars += [result[p], FIG2[p]]
    left = [0.0] * len(bars)
    for key, color in zip(SHARE_KEYS, COLORS):
        widths = [100 * b[key] for b in bars]
        ax.barh(names, widths, left=left, color=color, label=LABELS[key])
        left = [a + w for a, w in zip(left, widths)]
    for i, b in enumerate(bars):
        ax.text(1, i, f"{100 * b['token_states']:.1f}%", va="center", fontsize=8, color="white")
    # the token-state share's 95% interval over seeds, at the end of our green segments
    ours = [2 * i for i in range(len(policies))]
    xs = [100 * result[p]["token_states"] for p in policies]
    xerr = error_bars(result, [f"{p}/token_states" for p in policies], scale=100)
    ax.errorbar(xs, ours, xerr=xerr, fmt="none", ecolor="black", capsize=3, lw=1)
    ax.invert_yaxis()
    ax.set_xlabel("share of the KV pool (%)")
    ax.set_xlim(0, 100)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=8, y=-0.02)
    return fig


def measure(exp: Experiment) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """One seed: every policy on one workload; the shares and details per policy, CSV rows."""
    c = exp.cfg
    window = tuple(c["window"])
    workload = exp.workload()
    result: dict[str, Any] = {}
    details: dict[str, Any] = {}
    rows = []
    for policy in c["policies"]:
        trace = exp.run(
            workload, policy, exp.settings(policy), stop_time=window[1], memory_window=window,
            memory_every=int(c.get("memory_every", 1)),
        )  # fmt: skip
        shares = memory_shares(trace.iterations, window)
        result[policy] = shares
        its = [i for i in trace.iterations if window[0] <= i.time <= window[1]]
        details[policy] = {
            "mean_batched_requests": mean_batched_requests(trace.iterations, window),
            "mean_kv_usage": sum(i.kv_usage for i in its) / max(1, len(its)),
            "iterations_in_window": len(its),
            "preemptions": sum(i.num_preemptions for i in trace.iterations),
            "num_kv_blocks": trace.num_kv_blocks,
            "wall_time_s": trace.wall_time_s,
        }
        rows.append(
            {
                "policy": policy,
                **shares,
                **{f"paper_{k}": FIG2.get(policy, {}).get(k) for k in SHARE_KEYS},
            }
        )
        exp.logger.log({f"{policy}/{k}": v for k, v in shares.items()})
    if "paged" in result:
        free = result["paged"]["external_fragmentation"]  # the paged policy's only "external"
        result["paged_artifact_presentation"] = artifact_presentation(result["paged"], free)
    result["details"] = details
    return result, rows, [workload]


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Run every policy on one workload per seed; write fig2.json / .csv / .png (means and
    95% intervals over the seeds) into ``out_dir``."""
    exp = setup(cfg, out_dir)
    window = tuple(exp.cfg["window"])
    result, rows, used = over_seeds(exp, measure)
    if "paged" in result:
        result["acceptance"] = acceptance(result)  # on the means
    result["window_s"] = list(window)
    result["paper"] = FIG2
    result["run_info"] = exp.provenance(used)
    workload = used[0]
    n = result["seeds"]["n"]
    title = (
        f"Fig. 2, {exp.label([workload])}, {workload.request_rate:g} req/s, window {window}, "
        f"mean of {n} seed{'s' * (n > 1)}"
    )
    paths = write_results(exp, "fig2", result, rows, plot(exp, result, title))
    exp.logger.finish()
    for policy in (p for p in FIG2 if p in result):
        s = stat(result, f"{policy}/token_states") or {}
        interval = (
            f" [{100 * s['ci95_low']:.1f}, {100 * s['ci95_high']:.1f}]"
            if s.get("ci95_low") is not None
            else ""
        )
        ts, paper = result[policy]["token_states"], FIG2[policy]["token_states"]
        print(f"{policy:12s} token states {100 * ts:5.1f}%{interval}  (paper {100 * paper:.1f}%)")
    print(f"fig2 ({exp.executor.describe()}, {n} seeds): {', '.join(str(p) for p in paths)}")
    return paths


@hydra.main(config_path="../configs", config_name="fig2", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
