"""vLLM's metric reader types (``vllm.v1.metrics.reader``), built from the metric families of
metrics/serving_stats.py: what ``LLM.get_metrics`` returns, with no text format in between."""

from __future__ import annotations

from dataclasses import dataclass

from paged_llm.metrics.serving_stats import PER_POSITION, Family

PREFIXES = ("vllm:", "paged_llm:")


@dataclass
class Metric:
    """A named metric with its labels (one name may come with several label sets)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (only ``PER_POSITION``)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Cumulative bucket counts by upper bound (the ``le`` label, '+Inf' included)."""

    count: int
    sum: float
    buckets: dict[str, int]


def from_families(families: list[Family]) -> list[Metric]:
    """vLLM's reader types, as ``LLM.get_metrics`` returns them: counters named without
    ``_total``, one Histogram per label set, ``PER_POSITION`` as one Vector."""
    out: list[Metric] = []
    for f in families:
        if not f.name.startswith(PREFIXES):
            continue
        if f.kind == "gauge":
            out += [Gauge(f.name, dict(labels), float(v)) for labels, v in f.samples]
        elif f.kind == "histogram":
            out += [Histogram(f.name, dict(labels), h.count, h.sum, dict(h.buckets))
                    for labels, h in f.samples]  # fmt: skip
        elif f.name == PER_POSITION:
            labels = {k: v for k, v in f.samples[0][0].items() if k != "position"}
            out.append(Vector(f.name, labels, [int(v) for _, v in f.samples]))
        else:
            out += [Counter(f.name, dict(labels), int(v)) for labels, v in f.samples]
    return out
