"""The Hydra callback every experiment's multirun uses: after the last job, merge the jobs'
result JSON into ``sweep.csv``, ``sweep.md`` and ``sweep.png`` in the sweep directory, and put
the table on the logger's group (W&B: a summary run beside the jobs' runs)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig

from paged_llm.metrics import sweep_jobs, sweep_table


def sweep_group(sweep_dir: str | Path) -> str:
    """The logger group of a sweep's runs: the sweep directory's name."""
    return Path(sweep_dir).name


class SweepSummary(Callback):
    """Merge every job's ``result`` file into one table; ``columns`` maps a column name to a
    dotted path in that JSON, ``plot`` names the column drawn per job, and ``describe`` the
    columns whose values the title states (real or simulated, the hardware). ``check`` is the
    dotted path of the experiment's own config check, run on every job before the first."""

    def __init__(
        self,
        result: str,
        columns: Mapping[str, str] | None = None,
        plot: str | None = None,
        name: str | None = None,
        describe: tuple[str, ...] = ("mode", "hardware"),
        check: str | None = None,
    ) -> None:
        self.result = result
        self.columns = dict(columns or {})
        self.plot = plot
        self.name = name or Path(result).stem
        self.describe = list(describe)
        self.check = check

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Compose (and check) every job first: a bad override stops the sweep before work."""
        check = get_method(self.check) if self.check else None
        for overrides in sweep_jobs.job_overrides(config):
            try:
                job = sweep_jobs.compose_job(config, overrides)
                if check is not None:
                    check(job)
            except Exception as err:
                # Hydra turns a callback's exception into a warning and sweeps on; SystemExit
                # stops the sweep.
                job_text = " ".join(overrides)
                raise SystemExit(f"sweep stopped before any job ran; [{job_text}]:\n{err}") from err

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the merged files; hand them to the configured logger."""
        sweep_dir = Path(config.hydra.sweep.dir)
        rows, paths = self.merge(sweep_dir)
        if rows:
            print(f"{self.name} sweep of {len(rows)} jobs: {', '.join(str(p) for p in paths)}")
            self.log_summary(config, sweep_dir, rows, paths)

    def merge(self, sweep_dir: Path) -> tuple[list[dict[str, Any]], list[Path]]:
        """The merged rows and the files written (none when no job left a result)."""
        rows, swept = sweep_table.collect_rows(sweep_dir, self.result, self.columns)
        if not rows:
            return rows, []
        keys = list(dict.fromkeys(["job", *swept, *self.columns]))
        title = f"{self.name}: {len(rows)} jobs, varying {', '.join(swept) or 'nothing'}"
        where = [str(v) for k in self.describe for v in dict.fromkeys(r.get(k) for r in rows) if v]
        title += f" ({'; '.join(where)})" if where else ""
        md = sweep_dir / "sweep.md"
        md.write_text(sweep_table.markdown(rows, keys, title))
        paths = [sweep_table.write_csv(sweep_dir / "sweep.csv", rows), md]
        if self.plot:
            png = sweep_dir / "sweep.png"
            paths.append(sweep_table.plot(png, rows, swept, self.plot, title))
        return rows, paths

    def log_summary(
        self, config: DictConfig, sweep_dir: Path, rows: list[dict[str, Any]], paths: list[Path]
    ) -> None:
        """The merged table and files as one summary run in the sweep's logger group."""
        if config.get("logger") is None:
            return
        logger = instantiate(config.logger)
        logger.log_sweep(sweep_group(sweep_dir), f"{self.name}-summary", rows, paths)
