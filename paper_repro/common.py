"""What every figure script shares: building executors, settings and workloads from the
composed config, running one policy, provenance, and writing JSON / CSV / PNG results."""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from paged_llm.metrics.run_info import cpu_name, run_info
from paged_llm.metrics.serving import RunTrace
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import Workload, WorkloadSpec, build_workload
from paper_repro.real_mode import apply_probe, prepare_config
from paper_repro.verdicts import acceptance_lines

log = logging.getLogger("paper_repro")
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class Experiment:
    """A composed config made concrete: executor, logger, output directory."""

    cfg: dict[str, Any]  # resolved config (plain containers)
    executor: Any
    logger: Any
    out_dir: Path
    seed: int | None = None  # the workload seed of the current run (seeds.over_seeds sets it)

    @property
    def mode(self) -> str:
        """'real' or 'simulated'."""
        return self.executor.mode

    def settings(self, policy: str | None = None, **overrides: Any) -> ServingSettings:
        """Engine settings, with the policy's own overrides (e.g. max_num_seqs) applied."""
        per_policy = (self.cfg.get("policies") or {}).get(policy) or {}
        return ServingSettings(**{**self.cfg["engine"], **per_policy, **overrides})

    def workload(self, base: dict[str, Any] | None = None, **overrides: Any) -> Workload:
        """The configured workload (or ``base``), at the current seed, with overrides such as
        request_rate."""
        seed = {} if self.seed is None else {"seed": self.seed}
        spec = {**(base if base is not None else self.cfg["workload"]), **seed, **overrides}
        return build_workload(WorkloadSpec(**spec))

    def run(
        self, workload: Workload, policy: str, settings: ServingSettings, **kw: Any
    ) -> RunTrace:
        """One run of one policy; logs where it ran and how long it took."""
        kw.setdefault("progress", bool(self.cfg.get("progress", False)))
        trace = self.executor.run(workload, policy, settings, **kw)
        log.info(
            "%s @ %.3g req/s: %d iterations, %.1f s %s time, %.1f s wall (%s)",
            trace.policy, workload.request_rate, len(trace.iterations), trace.end_time,
            "simulated" if self.mode == "simulated" else "real", trace.wall_time_s, trace.hardware,
        )  # fmt: skip
        return trace

    def provenance(self, workloads: list[Workload] | None = None) -> dict[str, Any]:
        """run_info plus what was simulated (or run), where, and on which lengths."""
        info = run_info(self.mode, hardware=self.executor.describe())
        info["command"] = module_command(info["command"])
        info["computed_on"] = f"{cpu_name()} (CPU)"
        for key in ("kv_budget", "probe", "budget_s"):  # how a real run was sized
            if self.cfg.get(key):
                info[key] = self.cfg[key]
        if workloads:
            info["workloads"] = [w.describe() for w in workloads]
            info["synthetic_lengths"] = any(w.synthetic for w in workloads)
        cm = getattr(self.executor, "cost_model", None)
        if cm is not None:
            model = cm(self.cfg["engine"]["block_size"])
            info["cost_model"] = {
                k: v for k, v in model.to_dict().items() if k not in ("hardware", "model")
            }
            info["calibration"] = self.executor.calibration
        return info

    def label(self, workloads: list[Workload] | None = None) -> str:
        """One line for figure titles: real/simulated, hardware, trace or synthetic lengths."""
        text = self.executor.describe()
        if workloads:
            kinds = {("synthetic " if w.synthetic else "trace ") + w.name for w in workloads}
            text += " | " + ", ".join(sorted(kinds)) + " lengths"
        return text


def module_command(command: str) -> str:
    """``python /repo/paper_repro/fig2.py a=b`` -> ``python -m paper_repro.fig2 a=b``."""
    parts = command.split(" ")
    if len(parts) > 1 and parts[1].endswith(".py"):
        path = Path(parts[1]).resolve()
        root = CONFIG_DIR.parent
        packages = [root / name for name in ("paper_repro", "experiments", "paged_llm")]
        if any(pkg in path.parents for pkg in packages):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            parts[1:2] = ["-m", module]
    return " ".join(parts)


def setup(cfg: DictConfig | dict[str, Any], out_dir: str | Path) -> Experiment:
    """Resolve the config, build the executor and logger, create the output directory."""
    resolved = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    resolved = prepare_config(resolved)  # policy filter, KV and time budgets (real_mode.py)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    executor = instantiate(resolved["executor"], _convert_="all")
    logger = instantiate(
        resolved.get("logger") or {"_target_": "paged_llm.metrics.loggers.NullLogger"}
    )
    exp = Experiment(resolved, executor, logger, out)
    if resolved.get("probe"):
        apply_probe(exp)  # rates from the engine's measured capacity
    logger.log_config(resolved)
    return exp


def _clean(obj: Any) -> Any:
    """JSON-safe: nan/inf become None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write_results(
    exp: Experiment, name: str, result: dict[str, Any], rows: list[dict[str, Any]], fig: Any
) -> list[Path]:
    """Write ``name``.json (result + run_info + config), .csv (rows) and .png (figure); log them."""
    paths = []
    js = exp.out_dir / f"{name}.json"
    payload = {**result, "config": exp.cfg}
    js.write_text(json.dumps(_clean(payload), indent=2))
    paths.append(js)
    if rows:
        path = exp.out_dir / f"{name}.csv"
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        paths.append(path)
    if fig is not None:
        import matplotlib.pyplot as plt

        path = exp.out_dir / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    for p in paths:
        exp.logger.log_file(p)
    for line in acceptance_lines(name, result.get("acceptance") or {}):
        print(line)
    return paths


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.0) -> tuple[Any, Any]:
    """A matplotlib figure on the non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """Compose a config from ``configs/`` (quick runs, tests), also from inside a Hydra app:
    the app's own Hydra state is put back afterwards."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    outer = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name, overrides=list(overrides or []))
    finally:
        # initialize_config_dir swaps the singleton on exit; restore on the current one
        GlobalHydra.instance().hydra = outer


def hydra_output_dir() -> Path:
    """The run directory of the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)
