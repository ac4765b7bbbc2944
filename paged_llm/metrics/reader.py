"""vLLM's metric reader types (``vllm.v1.metrics.reader``) and a parser that turns Prometheus text
(the server's ``/metrics``, or what ``LLM.get_metrics`` renders) into them."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The one counter vLLM reads as a vector: accepted drafts by position in the draft.
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
PREFIXES = ("vllm:", "paged_llm:")
_SAMPLE = re.compile(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


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


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _samples(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(family name -> type from the ``# TYPE`` lines, [(sample name, labels, value)])."""
    types: dict[str, str] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind.strip()
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            if match is None:
                raise ValueError(f"not a Prometheus sample line: {line!r}")
            name, labels, value = match.groups()
            pairs = {k: _unescape(v) for k, v in _LABEL.findall(labels or "")}
            samples.append((name, pairs, float(value)))
    return types, samples


def _key(labels: dict[str, str], drop: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def parse_metrics_text(text: str) -> list[Metric]:
    """Prometheus text format 0.0.4 -> vLLM's reader types, as ``LLM.get_metrics`` returns
    them: counters named without ``_total``, histograms folded into one object per label set,
    ``PER_POSITION`` as a Vector; only ``vllm:`` and ``paged_llm:`` metrics."""
    types, samples = _samples(text)
    out: list[Metric] = []
    for family, kind in types.items():
        if not family.startswith(PREFIXES):
            continue
        if kind == "gauge":
            out += [Gauge(family, labels, v) for n, labels, v in samples if n == family]
        elif kind == "counter":
            base = family.removesuffix("_total")
            mine = [(labels, v) for n, labels, v in samples if n == family]
            if base == PER_POSITION:
                by_labels: dict[tuple, dict[int, int]] = {}
                for labels, v in mine:
                    by_labels.setdefault(_key(labels, "position"), {})[
                        int(labels["position"])] = int(v)  # fmt: skip
                for key, per_pos in by_labels.items():
                    values = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)]
                    out.append(Vector(base, dict(key), values))
            else:
                out += [Counter(base, labels, int(v)) for labels, v in mine]
        elif kind == "histogram":
            folded: dict[tuple, Histogram] = {}
            for n, labels, v in samples:
                if n not in (f"{family}_bucket", f"{family}_count", f"{family}_sum"):
                    continue
                h = folded.setdefault(
                    _key(labels, "le"), Histogram(family, dict(_key(labels, "le")), 0, 0.0, {})
                )
                if n.endswith("_bucket"):
                    h.buckets[labels["le"]] = int(v)
                elif n.endswith("_count"):
                    h.count = int(v)
                else:
                    h.sum = v
            out += folded.values()
    return out
