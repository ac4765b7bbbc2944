"""The server's ``/metrics``: the metric families of paged_llm/metrics/serving_stats.py (vLLM's
names) rendered in Prometheus' text format by prometheus_client, and read back by its parser.

Each render builds a private registry over one snapshot, so several servers or engines in one
process never share (or collide in) prometheus_client's global registry.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families

from paged_llm.metrics.serving_stats import (  # noqa: F401 (the server's names for them)
    EngineGauges,
    Family,
    LoRAGauges,
    RequestStats,
    SpecDecodeCounts,
    engine_gauges,
)

_KINDS = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


class _Snapshot:
    """A prometheus_client collector over metric families computed beforehand."""

    def __init__(self, families: list[Family]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        """Each family as prometheus_client's metric family of its kind."""
        for f in self.families:
            names = list(f.samples[0][0]) if f.samples else []
            if f.kind == "histogram":
                metric = HistogramMetricFamily(f.name, f.help, labels=names)
                for labels, h in f.samples:
                    metric.add_metric(list(labels.values()), list(h.buckets), h.sum)
            else:
                metric = _KINDS[f.kind](f.name, f.help, labels=names)
                for labels, value in f.samples:
                    metric.add_metric(list(labels.values()), float(value))
            yield metric


class ServerMetrics(RequestStats):
    """A server's request counters and histograms, rendered with the engine's gauges."""

    def render(self, gauges: EngineGauges) -> str:
        """The whole exposition text (Prometheus text format 0.0.4)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self.families(gauges)))
        return generate_latest(registry).decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name with its labels (as exposed) -> value; for tests and quick scripts."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items())
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
