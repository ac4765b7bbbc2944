"""One table from a multirun's jobs: each job's Hydra overrides and chosen values of its result
JSON, written as CSV, markdown and a bar chart into the sweep directory."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

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
    column named like an override key replaces it), and the override keys the sweep varied."""
    rows, overrides = [], []
    for path in sorted(Path(sweep_dir).glob(f"*/{result}"), key=_job_key):
        data = json.loads(path.read_text())
        overrides.append(job_overrides(path.parent))
        row: dict[str, Any] = {"job": path.parent.name, **overrides[-1]}
        row.update({name: lookup(data, dotted) for name, dotted in columns.items()})
        rows.append(row)
    keys = dict.fromkeys(k for job in overrides for k in job)
    swept = [k for k in keys if len({job.get(k) for job in overrides}) > 1]
    return rows, swept


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


def markdown(rows: list[dict[str, Any]], keys: list[str], title: str) -> str:
    """A markdown table of the given keys, under a heading."""
    lines = [f"# {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(
    path: Path, rows: list[dict[str, Any]], labels: list[str], metric: str, title: str
) -> Path:
    """A horizontal bar per job of ``metric``, labelled by its swept values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [", ".join(f"{k}={r.get(k)}" for k in labels) or r["job"] for r in rows]
    values = [float(r[metric]) if isinstance(r.get(metric), int | float) else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    ax.barh(range(len(rows)), values)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()  # job 0 on top, as in the table
    ax.set_xlabel(metric)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
