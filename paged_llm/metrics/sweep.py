"""The Hydra callback every experiment's and figure's multirun uses. Before the first job it
composes (and checks) every job; in each job it pins the torch threads to the job's share of the
host and records where the job ran; after the last job it merges the jobs' result JSON into the
sweep directory: ``sweep.csv`` (a row per job), ``sweep_mean.csv`` (a row per configuration:
the overrides less the seed, each column's mean and 95% interval), ``sweep.md`` (both tables)
and ``sweep.png``, and puts the table on the logger's group (W&B: a summary run beside the
jobs' runs)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig

from paged_llm.metrics import sweep_hosts, sweep_jobs, sweep_table

# Overrides that draw another sample of the same configuration, not another configuration.
SEED_KEYS = ("seeds", "seed", "workload.seed", "+seed")


def sweep_group(sweep_dir: str | Path, job_name: str | None = None) -> str:
    """The logger group of a sweep's runs: the experiment and the sweep directory's name."""
    return f"{job_name}-{Path(sweep_dir).name}" if job_name else Path(sweep_dir).name


def _is_index(step: str) -> bool:
    return step.isdigit()


def default_columns(data: Mapping[str, Any]) -> dict[str, str]:
    """A figure's columns when none are configured: real or simulated, the hardware, and each
    quantity it measured over seeds that is not a point of a curve (no list index in its path)."""
    columns = {"mode": "run_info.mode", "hardware": "run_info.hardware"}
    stats = sweep_table.lookup(data, "seeds.stats") or {}
    for path in stats:
        steps = path.split("/")
        if not any(map(_is_index, steps)) and steps[0] not in ("details", "config", "run_info"):
            columns[path.replace("/", "_")] = path.replace("/", ".")
    return columns


class SweepSummary(Callback):
    """Merge every job's ``result`` file (default: ``<job name>.json``) into one table;
    ``columns`` maps a column name to a dotted path in that JSON (default: see
    :func:`default_columns`), ``plot`` names the column drawn, ``describe`` the columns whose
    values the title states (real or simulated, the hardware). ``check`` is the dotted path of
    the experiment's own config check, run on every job before the first. ``seed_keys`` are the
    overrides merged into one configuration's samples; ``threads_per_job`` fixes each job's
    torch threads (default: the host's cores over the jobs the launcher runs at once)."""

    def __init__(
        self,
        result: str | None = None,
        columns: Mapping[str, str] | None = None,
        plot: str | None = None,
        name: str | None = None,
        describe: tuple[str, ...] = ("mode", "hardware"),
        check: str | None = None,
        seed_keys: tuple[str, ...] = SEED_KEYS,
        threads_per_job: int | None = None,
    ) -> None:
        self.result = result
        self.columns = dict(columns or {})
        self.plot = plot
        self.name = name or (Path(result).stem if result else None)
        self.describe = list(describe)
        self.check = check
        self.seed_keys = list(seed_keys)
        self.threads_per_job = threads_per_job
        self.n_jobs = 1 << 20  # until on_multirun_start counts them

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Compose (and check) every job first: a bad override stops the sweep before work."""
        check = get_method(self.check) if self.check else None
        jobs = sweep_jobs.job_overrides(config)
        self.n_jobs = len(jobs) or self.n_jobs
        for overrides in jobs:
            try:
                job = sweep_jobs.compose_job(config, overrides)
                if check is not None:
                    check(job)
            except Exception as err:
                # Hydra turns a callback's exception into a warning and sweeps on; SystemExit
                # stops the sweep.
                job_text = " ".join(overrides)
                why = f"{err}\n{err.__cause__}" if err.__cause__ else str(err)  # the key's path
                raise SystemExit(f"sweep stopped before any job ran; [{job_text}]:\n{why}") from err

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """In a multirun job: pin its threads, warn when jobs share the host, record it."""
        if config.hydra.mode.name != "MULTIRUN":
            return
        at_once = sweep_hosts.jobs_at_once(config.hydra.launcher, self.n_jobs)
        threads = sweep_hosts.threads_per_job(at_once, self.threads_per_job)
        sweep_hosts.start_job(Path(config.hydra.runtime.output_dir), at_once, threads)

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Stamp the job's end time (the merge counts the jobs that overlapped)."""
        if config.hydra.mode.name == "MULTIRUN":
            sweep_hosts.end_job(Path(config.hydra.runtime.output_dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the merged files; hand them to the configured logger."""
        sweep_dir = Path(config.hydra.sweep.dir)
        job_name = str(config.hydra.job.name)
        rows, paths = self.merge(sweep_dir, job_name)
        if rows:
            name = self.name or job_name
            print(f"{name} sweep of {len(rows)} jobs: {', '.join(str(p) for p in paths)}")
            self.log_summary(config, sweep_dir, rows, paths)

    def merge(
        self, sweep_dir: Path, job_name: str | None = None
    ) -> tuple[list[dict[str, Any]], list[Path]]:
        """The per-job rows and the files written (none when no job left a result)."""
        result = self.result or f"{job_name}.json"
        rows, data, swept = sweep_table.collect_jobs(sweep_dir, result, self.columns)
        if not rows:
            return rows, []
        columns = self.columns or default_columns(data[0])
        if not self.columns:
            rows, data, swept = sweep_table.collect_jobs(sweep_dir, result, columns)
        configs = [k for k in swept if k not in self.seed_keys]
        merged = sweep_table.merge_configurations(rows, data, columns, configs)
        keys = list(dict.fromkeys(["job", *swept, *columns]))
        keys += [k for k in ("host", "threads", "jobs_on_host") if any(k in r for r in rows)]
        name = self.name or job_name or Path(result).stem
        title = f"{name}: {len(rows)} jobs, varying {', '.join(swept) or 'nothing'}"
        where = [str(v) for k in self.describe for v in dict.fromkeys(r.get(k) for r in rows) if v]
        title += f" ({'; '.join(where)})" if where else ""
        text = sweep_table.markdown(rows, keys, title)
        text += "\n" + self.merged_markdown(merged, configs, columns, len(rows))
        shared = max((r.get("jobs_on_host") or 1 for r in rows), default=1)
        if shared > 1:
            text += (f"\nWarning: up to {shared} jobs ran at once on one host; their timings "
                     "are of a shared machine (jobs_on_host per job).\n")  # fmt: skip
        md = sweep_dir / "sweep.md"
        md.write_text(text)
        paths = [
            sweep_table.write_csv(sweep_dir / "sweep.csv", rows),
            sweep_table.write_csv(sweep_dir / "sweep_mean.csv", merged),
            md,
        ]
        if self.plot:
            png = sweep_dir / "sweep.png"
            paths.append(sweep_table.plot(png, merged, configs, self.plot, title))
        return rows, paths

    @staticmethod
    def merged_markdown(
        merged: list[dict[str, Any]], configs: list[str], columns: Mapping[str, str], n: int
    ) -> str:
        """The per-configuration table: each numeric column as ``mean [low, high]``."""
        keys = [*configs, "jobs", "samples", *columns]
        cells = []
        for row in merged:
            cell = dict(row)
            for name in columns:
                low, high = row.get(f"{name}_ci95_low"), row.get(f"{name}_ci95_high")
                if isinstance(row.get(name), float) and low is not None:
                    cell[name] = f"{row[name]:.4g} [{low:.4g}, {high:.4g}]"
            cells.append(cell)
        title = (
            f"Mean and 95% interval per configuration ({n} jobs in {len(merged)}: their "
            "overrides less the seed; Student-t over every seed of a configuration's jobs)"
        )
        return sweep_table.markdown(cells, keys, title, level=2)

    def log_summary(
        self, config: DictConfig, sweep_dir: Path, rows: list[dict[str, Any]], paths: list[Path]
    ) -> None:
        """The merged table and files as one summary run in the sweep's logger group."""
        if config.get("logger") is None:
            return
        logger = instantiate(config.logger)
        job_name = str(config.hydra.job.name)
        group = sweep_group(sweep_dir, job_name)
        name = f"{self.name or job_name}-summary"
        logger.log_sweep(group, name, rows, paths, run_dir=sweep_dir)
