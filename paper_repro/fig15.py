"""Fig. 15: memory saved by sharing KV blocks with parallel sampling and beam search.
``python -m paper_repro.fig15 [overrides]`` (simulated OPT-13B on an A100-40GB; Alpaca and
ShareGPT lengths; ``--config-name fig15_quick`` for a CI-sized run).

The saving is the paper's: 1 - blocks in use with sharing / blocks the same sequences would hold
without it. At every iteration it is read off the real paged KV manager: the running sequences'
block tables, each shared block counted once (with sharing) or once per sequence holding it
(without); both are averaged over the run, weighted by iteration time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from paper_repro.common import Experiment, figure, hydra_output_dir, setup, write_results
from paper_repro.paper_numbers import FIG15, FIG15_SHAREGPT_RANGE, FIG15_TOLERANCE_PP
from paper_repro.seeds import error_bars, over_seeds
from paper_repro.verdicts import check


def measure(exp: Experiment, spec: dict[str, Any], policy: str) -> dict[str, Any]:
    """One run of the workload ``spec``: the saving and what could disturb it (preemptions)."""
    workload = exp.workload(base=spec)
    trace = exp.run(workload, policy, exp.settings(policy), memory_every=0)
    sharing = trace.extra.get("sharing")
    if sharing is None:
        raise ValueError(f"policy '{policy}' does not share blocks; Fig. 15 needs 'paged'")
    return {
        "saving": sharing["saving"],
        "mean_iteration_saving": sharing["mean_iteration_saving"],
        "iterations": sharing["iterations"],
        "num_preemptions": sum(r.num_preemptions for r in trace.requests),
        "completed": sum(r.finished for r in trace.requests),
        "num_requests": len(trace.requests),
    }


def kind(setting: str) -> str:
    """'parallel' or 'beam'."""
    return setting.split("_")[0]


def acceptance(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """On Alpaca: the paper's ordering (n / width up -> saving up; beam above parallel) and
    every saving within FIG15_TOLERANCE_PP percentage points of the paper's."""
    ours = {s: r["saving"] for s, r in result.get("alpaca", {}).items() if s in FIG15["alpaca"]}
    if not ours:
        return {}
    checks = {}
    paper = FIG15["alpaca"]
    order = sorted(ours, key=lambda s: paper[s])
    ok = all(ours[a] < ours[b] for a, b in zip(order, order[1:]))
    checks["alpaca_ordering"] = check(sorted(ours, key=ours.get), order, order, ok)
    for s, v in ours.items():
        err = 100 * (v - paper[s])
        checks[f"alpaca_{s}"] = check(
            v, paper[s], f"within {FIG15_TOLERANCE_PP:g} pp", abs(err) <= FIG15_TOLERANCE_PP,
            error_pp=err,
        )  # fmt: skip
    return checks


def paper_value(workload: str, setting: str) -> Any:
    """The paper's number (Alpaca) or range over n / width 2-6 (ShareGPT)."""
    if setting in FIG15.get(workload, {}):
        return FIG15[workload][setting]
    if workload == "sharegpt":
        return list(FIG15_SHAREGPT_RANGE[kind(setting)])
    return None


def plot(result: dict[str, Any], workloads: list[str], title: str) -> Any:
    """Bars of the saving per setting, the paper's beside (ShareGPT: its range as a band);
    whiskers on beam search span the 'own' (least) to 'best' (most sharing) parent models."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, axes = figure(ncols=len(workloads), width=5.5, height=3.8)
    for ax, w in zip(axes[0], workloads):
        settings = [s for s in result[w] if isinstance(result[w][s], dict)]
        xs = list(range(len(settings)))
        ours = [100 * result[w][s]["saving"] for s in settings]
        yerr = error_bars(result, [f"{w}/{s}/saving" for s in settings], scale=100)
        ax.bar([x - 0.2 for x in xs], ours, width=0.4, yerr=yerr, capsize=3, color="tab:blue")
        for x, s, v in zip(xs, settings, ours):
            ax.text(x - 0.2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
            b = result[w][s].get("bounds")
            if b:
                lo, hi = 100 * b["own"], 100 * b["best"]
                ax.plot([x - 0.2, x - 0.2], [lo, hi], color="black", lw=0.8)
            ref = paper_value(w, s)
            if isinstance(ref, float):
                ax.bar(x + 0.2, 100 * ref, width=0.4, color="tab:orange", alpha=0.6)
                label = f"{100 * ref:.1f}"
                ax.text(x + 0.2, 100 * ref, label, ha="center", va="bottom", fontsize=7)
            elif ref:
                ax.bar(
                    x + 0.2, 100 * (ref[1] - ref[0]), bottom=100 * ref[0], width=0.4,
                    color="tab:orange", alpha=0.3, hatch="//",
                )  # fmt: skip
        handles = [
            Patch(color="tab:blue", label="ours (simulated)"),
            Patch(color="tab:orange", alpha=0.6, label="paper (ShareGPT: its range)"),
            Line2D([], [], color="black", lw=0.8, label="beam parents own..best"),
        ]
        ax.set_xticks(xs, [s.replace("_", "\n") for s in settings], fontsize=8)
        ax.set_ylabel("memory saved by sharing (%)")
        ax.set_title(f"{w} @ {result[w]['request_rate']:g} req/s", fontsize=9)
        ax.legend(handles=handles, fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=8, y=-0.02)
    return fig


def measure_all(exp: Experiment) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """One seed: the saving for every workload and setting (and the beam-parent bounds)."""
    c = exp.cfg
    policy = c.get("kv_policy", "paged")
    result: dict[str, Any] = {}
    rows = []
    used = []
    for wname in [w for w, base in c["workloads"].items() if base is not None]:
        base = c["workloads"][wname]
        used.append(exp.workload(base=base))
        result[wname] = {"request_rate": float(base["request_rate"])}
        for name, overrides in c["settings"].items():
            if overrides is None:
                continue
            spec = {**base, **overrides}
            beam = int(overrides.get("beam_width", 1)) > 1
            if beam:
                spec["beam_parents"] = c.get("beam_parents", "uniform")
            r = measure(exp, spec, policy)
            if c.get("beam_bounds") and beam:
                r["bounds"] = {
                    parents: measure(exp, {**spec, "beam_parents": parents}, policy)["saving"]
                    for parents in ("own", "uniform", "best")
                    if parents != spec["beam_parents"]
                }
            r["paper"] = paper_value(wname, name)
            result[wname][name] = r
            rows.append({"workload": wname, "setting": name, **r})
            exp.logger.log({f"{wname}/{name}/saving": r["saving"]})
    return result, rows, used


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Measure the saving for every workload and setting, once per seed; write fig15.json /
    .csv / .png (means and 95% intervals over the seeds)."""
    exp = setup(cfg, out_dir)
    c = exp.cfg
    policy = c.get("kv_policy", "paged")
    workloads = [w for w, base in c["workloads"].items() if base is not None]
    result, rows, used = over_seeds(exp, measure_all)
    result["acceptance"] = acceptance(result)  # on the means
    result["paper"] = {"alpaca": FIG15["alpaca"], "sharegpt_range": FIG15_SHAREGPT_RANGE}
    result["tolerance_pp"] = FIG15_TOLERANCE_PP
    result["beam_parents"] = c.get("beam_parents", "uniform")
    result["run_info"] = exp.provenance(used)
    title = f"Fig. 15, {exp.label(used)}, policy {policy}"
    paths = write_results(exp, "fig15", result, rows, plot(result, workloads, title))
    exp.logger.finish()
    print(f"{'workload':9s} {'setting':11s} {'ours %':>7s} {'paper %':>12s}  bounds (own..best)")
    for w in workloads:
        for name, r in ((k, v) for k, v in result[w].items() if isinstance(v, dict)):
            ref = r["paper"]
            ref_s = (
                f"{100 * ref:.2f}" if isinstance(ref, float)
                else f"{100 * ref[0]:.1f}-{100 * ref[1]:.1f}" if ref else "-"
            )  # fmt: skip
            b = r.get("bounds")
            bounds = f"{100 * b['own']:.1f}..{100 * b['best']:.1f}" if b else ""
            print(f"{w:9s} {name:11s} {100 * r['saving']:7.2f} {ref_s:>12s}  {bounds}")
    for k, a in result["acceptance"].items():
        print(f"check {k}: {'pass' if a['pass'] else 'FAIL'}")
    print(f"fig15 ({exp.executor.describe()}): {', '.join(str(p) for p in paths)}")
    return paths


@hydra.main(config_path="../configs", config_name="fig15", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
