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
        self, group: str, name: str, rows: list[dict[str, Any]], paths: list[str | Path]
    ) -> None:
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
    """Weights & Biases: one run per (multi)run job, grouped by sweep; offline by default."""

    def __init__(
        self, project: str = "paged-llm", mode: str = "offline", group: str | None = None
    ) -> None:
        self.project, self.mode, self.group = project, mode, group
        self._run = None

    def log_config(self, config: dict[str, Any]) -> None:
        """Start the run with the resolved config (group = the Hydra sweep directory)."""
        group, job_name = self.group, None
        try:
            from hydra.core.hydra_config import HydraConfig

            hc = HydraConfig.get()
            if hc.mode.name == "MULTIRUN":
                group = group or Path(hc.sweep.dir).name  # sweep.sweep_group: the same name
                job_name = f"{hc.job.name}-{hc.job.num}"
        except ValueError:  # not inside a Hydra app
            pass
        self._start(config, group, job_name, "job")

    def _start(self, config: dict[str, Any], group: str | None, name: str | None,
               job_type: str) -> None:  # fmt: skip
        """Open a W&B run (offline unless mode says otherwise)."""
        import wandb

        self._run = wandb.init(
            project=self.project, mode=self.mode, group=group, name=name, job_type=job_type,
            config=config, reinit="finish_previous",
        )  # fmt: skip

    def log_sweep(
        self, group: str, name: str, rows: list[dict[str, Any]], paths: list[str | Path]
    ) -> None:
        """A summary run in the sweep's group: the merged table, its CSV / markdown / plot."""
        import wandb

        self._start({"jobs": len(rows)}, self.group or group, name, "sweep-summary")
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
