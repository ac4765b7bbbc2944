"""One table from a multirun's jobs: each job's Hydra overrides and chosen values of its result
JSON, written as CSV, markdown and a bar chart into the sweep directory; and the same merged
per configuration (the overrides less the seed): each column's mean and 95% interval."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from paged_llm.metrics import sweep_hosts

MISSING = None  # a column whose path a job's JSON lacks (e.g. the GPU name on a CPU run)


def lookup(data: Any, path: str) -> Any:
    """The value at a dotted path (``systems.paged_llm.output_tokens_per_s``; list indices as
    numbers), or None when a step is missing."""
    for step in path.split("."):
        if isinstance(data, Mapping):
            data = data.get(step, MISSING)
        elif isinstance(data, list) and step.isdigit() and int(step) < len(data):
            data = data[int(step)]
        else:
            return MISSING
    return data


def job_overrides(job_dir: Path) -> dict[str, str]:
    """The job's command-line overrides (``.hydra/overrides.yaml``) as key -> value."""
    path = job_dir / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(path.read_text()) if path.is_file() else []
    return dict(item.split("=", 1) for item in items or [] if "=" in item)


def _job_key(path: Path) -> tuple[int, str]:
    """Jobs in launch order: numeric job directories first, by number."""
    name = path.parent.name
    return (int(name), name) if name.isdigit() else (1 << 30, name)


def collect_rows(
    sweep_dir: Path, result: str, columns: Mapping[str, str]
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per job directory holding ``result`` (job, its overrides, then the columns; a
    column named like an override key replaces it; then where it ran: host, threads and how many
    jobs shared the host while it ran), and the override keys the sweep varied."""
    rows, _, swept = collect_jobs(sweep_dir, result, columns)
    return rows, swept


def collect_jobs(
    sweep_dir: Path, result: str, columns: Mapping[str, str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """:func:`collect_rows` and, per row, the job's whole result JSON."""
    rows, overrides, data, records = [], [], [], []
    for path in sorted(Path(sweep_dir).glob(f"*/{result}"), key=_job_key):
        data.append(json.loads(path.read_text()))
        overrides.append(job_overrides(path.parent))
        records.append(sweep_hosts.read_record(path.parent))
        row: dict[str, Any] = {"job": path.parent.name, **overrides[-1]}
        row.update({name: lookup(data[-1], dotted) for name, dotted in columns.items()})
        rows.append(row)
    for row, record, shared in zip(rows, records, sweep_hosts.jobs_on_host(records)):
        if record:
            row.update(host=record["host"], threads=record["threads"], jobs_on_host=shared)
    keys = dict.fromkeys(k for job in overrides for k in job)
    swept = [k for k in keys if len({job.get(k) for job in overrides}) > 1]
    return rows, data, swept


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def sample_values(data: Any, dotted: str) -> list[float]:
    """A column's samples in one job's result: each seed's value where the job measured
    several (``seeds.stats``, paper_repro/seeds.py), else its one value (none if not a number)."""
    stats = lookup(data, "seeds.stats")
    stat = stats.get(dotted.replace(".", "/")) if isinstance(stats, Mapping) else None
    if stat and stat.get("per_seed"):
        return [float(v) for v in stat["per_seed"]]
    value = lookup(data, dotted)
    return [float(value)] if _is_number(value) else []


def merge_configurations(
    rows: list[dict[str, Any]],
    data: list[Any],
    columns: Mapping[str, str],
    group_keys: list[str],
) -> list[dict[str, Any]]:
    """One row per distinct configuration (the jobs sharing ``group_keys``' values): its jobs,
    samples (seeds over its jobs), then per numeric column the mean and Student-t 95% interval
    over every sample (paper_repro/seeds.py); other columns keep their value, or list each."""
    from paper_repro.seeds import summarize

    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(tuple(row.get(k) for k in group_keys), []).append(i)
    merged = []
    for key, members in groups.items():
        out: dict[str, Any] = dict(zip(group_keys, key))
        out["jobs"] = " ".join(str(rows[i]["job"]) for i in members)
        out["samples"] = sum(int(lookup(data[i], "seeds.n") or 1) for i in members)
        for name, dotted in columns.items():
            values = [v for i in members for v in sample_values(data[i], dotted)]
            if values:
                s = summarize(values)
                out[name], out[f"{name}_ci95_low"], out[f"{name}_ci95_high"] = (
                    s["mean"], s["ci95_low"], s["ci95_high"])  # fmt: skip
            else:
                seen = list(dict.fromkeys(rows[i].get(name) for i in members))
                out[name] = seen[0] if len(seen) == 1 else "; ".join(map(str, seen))
        hosts = dict.fromkeys(rows[i]["host"] for i in members if rows[i].get("host"))
        if hosts:
            out["host"] = ", ".join(hosts)
            out["jobs_on_host"] = max(rows[i].get("jobs_on_host") or 0 for i in members)
        merged.append(out)
    return merged


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Every row with every key as a column."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _cell(value: Any) -> str:
    """A markdown cell: floats to 4 significant digits, pipes escaped."""
    text = f"{value:.4g}" if isinstance(value, float) else ("-" if value is None else str(value))
    return text.replace("|", "\\|")


def markdown(rows: list[dict[str, Any]], keys: list[str], title: str, level: int = 1) -> str:
    """A markdown table of the given keys, under a heading of ``level``."""
    lines = [f"{'#' * level} {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(
    path: Path, rows: list[dict[str, Any]], labels: list[str], metric: str, title: str
) -> Path:
    """A horizontal bar per row (a job, or a configuration) of ``metric``, labelled by its
    swept values, with the 95% interval where the row has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [", ".join(f"{k}={r.get(k)}" for k in labels) or str(r.get("job")) for r in rows]
    values = [float(r[metric]) if isinstance(r.get(metric), int | float) else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    ends = [(r.get(f"{metric}_ci95_low"), r.get(f"{metric}_ci95_high")) for r in rows]
    xerr = [[v - lo if lo is not None else 0.0 for v, (lo, _) in zip(values, ends)],
            [hi - v if hi is not None else 0.0 for v, (_, hi) in zip(values, ends)]]  # fmt: skip
    ax.barh(range(len(rows)), values, xerr=xerr, capsize=3)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()  # job 0 on top, as in the table
    ax.set_xlabel(metric)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
