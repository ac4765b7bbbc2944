"""Experiment loggers, chosen by the ``logger`` config group: none, console or wandb."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class NullLogger:
    """Logs nothing (the default, and what tests use)."""

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the resolved run configuration."""

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record scalar metrics."""

    def log_file(self, path: str | Path) -> None:
        """Attach a result file (JSON, CSV, PNG)."""

    def finish(self) -> None:
        """Close the run."""

    def log_sweep(
        self, group: str, name: str, rows: list[dict[str, Any]], paths: list[str | Path],
        run_dir: str | Path | None = None,
    ) -> None:  # fmt: skip
        """Record a multirun's merged table and files (paged_llm/metrics/sweep.py)."""


class ConsoleLogger(NullLogger):
    """Prints metrics through the logging module."""

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Print scalar metrics."""
        log.info("step %s: %s", step, metrics)

    def log_file(self, path: str | Path) -> None:
        """Print the path of a result file."""
        log.info("wrote %s", path)


class WandbLogger(NullLogger):
    """Weights & Biases: one run per (multi)run job, offline by default. In a multirun the runs
    land in the sweep directory (``<sweep dir>/wandb``), grouped as ``<experiment>-<sweep
    directory's name>`` and each named by its job's overrides; a single run lands in its run
    directory (outside Hydra: $WANDB_DIR). ``dir`` puts them elsewhere;
    ``wandb sync DIR/wandb/offline-run-*`` uploads offline runs."""

    def __init__(
        self, project: str = "paged-llm", mode: str = "offline", group: str | None = None,
        dir: str | None = None,
    ) -> None:  # fmt: skip
        self.project, self.mode, self.group, self.dir = project, mode, group, dir
        self._run = None

    def log_config(self, config: dict[str, Any]) -> None:
        """Start the run with the resolved config, grouped, named and placed by its sweep."""
        group, job_name, run_dir = self.group, None, None
        try:
            from hydra.core.hydra_config import HydraConfig

            from paged_llm.metrics.sweep import sweep_group

            hc = HydraConfig.get()
            run_dir = hc.runtime.output_dir
            if hc.mode.name == "MULTIRUN":
                group = group or sweep_group(hc.sweep.dir, hc.job.name)
                job_name = " ".join(hc.overrides.task) or f"{hc.job.name}-{hc.job.num}"
                run_dir = hc.sweep.dir
        except ValueError:  # not inside a Hydra app
            pass
        self._start(config, group, job_name, "job", run_dir)

    def _start(self, config: dict[str, Any], group: str | None, name: str | None,
               job_type: str, run_dir: str | Path | None = None) -> None:  # fmt: skip
        """Open a W&B run (offline unless mode says otherwise) under ``dir``, else ``run_dir``
        (else wandb's own choice: $WANDB_DIR or the working directory)."""
        import wandb

        where = self.dir or run_dir
        if where:
            Path(where).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project, mode=self.mode, group=group, name=name, job_type=job_type,
            config=config, reinit="finish_previous", dir=str(where) if where else None,
        )  # fmt: skip

    def log_sweep(
        self, group: str, name: str, rows: list[dict[str, Any]], paths: list[str | Path],
        run_dir: str | Path | None = None,
    ) -> None:  # fmt: skip
        """A summary run in the sweep's group: the merged table, its CSV / markdown / plot."""
        import wandb

        self._start({"jobs": len(rows)}, self.group or group, name, "sweep-summary", run_dir)
        keys = list(dict.fromkeys(k for r in rows for k in r))
        table = wandb.Table(columns=keys, data=[[r.get(k) for k in keys] for r in rows],
                            allow_mixed_types=True)  # fmt: skip
        self._run.log({"sweep": table})
        for path in paths:
            self.log_file(path)
        self.finish()

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log scalars to the run."""
        if self._run is not None:
            self._run.log(metrics, step=step)

    def log_file(self, path: str | Path) -> None:
        """Log a PNG as an image, other files as run files."""
        if self._run is None:
            return
        import wandb

        path = Path(path)
        if path.suffix == ".png":
            self._run.log({path.stem: wandb.Image(str(path))})
        else:
            self._run.save(str(path), base_path=str(path.parent), policy="now")

    def finish(self) -> None:
        """Finish the run."""
        if self._run is not None:
            self._run.finish()
            self._run = None
