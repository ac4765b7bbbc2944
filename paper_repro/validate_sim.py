"""Validate the simulator against the real engine on this machine: time the engine's steps
over a grid, fit a calibration for this device, then run the Fig. 12 / 13 / 2 workloads both
for real and simulated (the same scheduler, a virtual clock priced by the fitted law) and
report them side by side with pass/fail. ``python -m paper_repro.validate_sim [overrides]``
(``--config-name validate_sim_quick``: the CI size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from paged_llm.metrics.loggers import NullLogger
from paged_llm.workloads.arrivals import Workload, WorkloadSpec, build_workload
from paper_repro.common import Experiment, hydra_output_dir, write_results
from paper_repro.validation.compare import Check, compare, plot, table
from paper_repro.validation.device_calibration import calibrate_here, fit_quality
from paper_repro.validation.drift import SpeedProbe
from paper_repro.validation.parts import PARTS, diagnostics, window_of


def part_workload(c: dict[str, Any], spec: dict[str, Any]) -> Workload:
    """The configured workload with a part's own overrides (rate, number of requests)."""
    own = {k: v for k, v in spec.items() if k != "window"}
    return build_workload(WorkloadSpec(**{**c["workload"], **own}))


def run_part(
    name: str, spec: dict[str, Any], real: Experiment, sim: Experiment, probe: SpeedProbe
) -> tuple[dict[str, Any], list[dict[str, Any]], Workload]:
    """Every policy on one figure's workload, real then simulated (with the real run's pool),
    the simulation as calibrated and at the speed the probe measured around the real run."""
    part = PARTS[name]
    workload = part_workload(real.cfg, spec)
    window = window_of([r.arrival_time for r in workload.requests], spec.get("window", [0, 1]))
    kw = {
        "stop_time": window[1] if part.stop_at_window else None,
        "memory_window": window if part.memory else None,
        "memory_every": 1 if part.memory else 0,
    }
    correct = bool(real.cfg["drift_correction"])
    values: dict[str, dict[str, float]] = {"real": {}, "simulated": {}, "as_calibrated": {}}
    runs: dict[str, Any] = {}
    for policy in real.cfg["compared_policies"]:
        settings = real.settings(policy)
        before = probe.time()
        rt = real.run(workload, policy, settings, **kw)
        speed = probe.drift(before, probe.time())
        pool = settings.with_overrides(num_gpu_blocks=rt.num_kv_blocks)
        st = sim.run(workload, policy, pool, **kw)  # at the calibration's speed
        values["real"][policy] = part.read(rt, window)
        values["as_calibrated"][policy] = part.read(st, window)
        cost = sim.executor.cost_model(settings.block_size)
        runs[policy] = {"speed": speed, "real": diagnostics(rt, cost),
                        "as_calibrated": diagnostics(st, cost)}  # fmt: skip
        if correct:
            with sim.executor.at_speed(speed):
                st = sim.run(workload, policy, pool, **kw)
                runs[policy]["drift_corrected"] = diagnostics(st, cost)
        values["simulated"][policy] = part.read(st, window)
    check = Check(**real.cfg["checks"][part.quantity])
    rows = compare(name, part.quantity, check, values["real"], values["simulated"])
    result = {
        "quantity": part.quantity,
        "workload": workload.describe(),
        "window_s": list(window),
        **values,
        "runs": runs,
    }
    return result, rows, workload


def run(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Calibrate, run every part real and simulated; write validate_sim.json / .csv / .png and
    calibration.json into ``out_dir``."""
    c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    real_exp, data, probe, sim = calibrate_here(c, out)
    real, path = real_exp.executor, out / "calibration.json"
    sim_exp = Experiment(c, sim, NullLogger(), out)
    fit = fit_quality(sim_exp.executor, data)
    print(f"fitted {data['law']} law: {fit['law']} (mean |error| on the grid "
          f"{100 * fit['mean_abs_relative_error']:.1f}%)")  # fmt: skip
    parts: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    used = []
    for name, spec in c["parts"].items():
        parts[name], part_rows, workload = run_part(name, spec, real_exp, sim_exp, probe)
        rows += part_rows
        used.append(workload)
    passed = sum(r["pass"] for r in rows)
    result = {
        "what": {
            "real": f"measured: the engine's steps and runs ({real.describe()})",
            "simulated": f"{sim_exp.executor.describe()}, calibrated by calibration.json"
            + (", at the speed probed around each real run" if c["drift_correction"] else ""),
        },
        "summary": {"passed": passed, "total": len(rows), "all_pass": passed == len(rows)},
        "comparison": rows,
        "parts": parts,
        "calibration": {"path": str(path), "clock": data["clock"], "fit": fit},
        "run_info": {"real": real_exp.provenance(used), "simulated": sim_exp.provenance(used)},
    }
    title = f"real: {real.describe()} | simulated: {sim_exp.executor.describe()}"
    paths = write_results(real_exp, "validate_sim", result, rows, plot(rows, title))
    print(f"real:      {result['what']['real']}, {data['clock']} clock")
    print(f"simulated: {result['what']['simulated']}")
    print(table(rows))
    print(f"{passed} of {len(rows)} within tolerance; {', '.join(str(p) for p in paths)}")
    return [*paths, path]


@hydra.main(config_path="../configs", config_name="validate_sim", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run(cfg, hydra_output_dir())


if __name__ == "__main__":
    main()
