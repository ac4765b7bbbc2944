"""Serving metrics (vLLM's benchmark and the paper's) on hand-made records."""

import math

import numpy as np
import pytest

from paged_llm.core.kv.base import MemoryBreakdown
from paged_llm.metrics.serving import (
    IterationRecord,
    RequestRecord,
    RunTrace,
    max_sustained_rate,
    mean_batched_requests,
    memory_shares,
    percentile,
    serving_metrics,
)


def test_percentile_matches_numpy():
    xs = [5.0, 1.0, 3.0, 10.0, 2.5, 7.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert math.isnan(percentile([], 50))


def test_serving_metrics_by_hand():
    a = RequestRecord("a", 10, 3, 0.0, 0.0, 1.0, 3.0, [1.0, 2.0, 3.0])
    b = RequestRecord("b", 20, 2, 1.0, 1.0, 1.5, 5.0, [1.5, 5.0])
    c = RequestRecord("c", 5, 4, 2.0)  # never finished
    trace = RunTrace([a, b, c], [], 6.0, "simulated", "test", "paged", 10, 16)
    m = serving_metrics(trace)
    assert m["completed"] == 2 and m["duration_s"] == 5.0
    assert m["request_throughput"] == pytest.approx(2 / 5)
    assert m["output_throughput"] == pytest.approx(5 / 5)
    assert m["total_token_throughput"] == pytest.approx(35 / 5)
    assert m["mean_ttft_ms"] == pytest.approx(750)
    assert m["mean_tpot_ms"] == pytest.approx(1000 * (1.0 + 3.5) / 2)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (1.0 + 1.0 + 3.5) / 3)
    assert m["median_e2el_ms"] == pytest.approx(3500)
    assert m["normalized_latency"] == pytest.approx((3.0 / 3 + 4.0 / 2) / 2)


def test_window_averages():
    mem = MemoryBreakdown(6, 2, 0, 8)
    its = [
        IterationRecord(t, 1.0, n, n, 0, 0, 0.5, 0, mem if t >= 1 else None)
        for t, n in ((0.0, 10), (1.0, 2), (2.0, 4), (3.0, 0))
    ]
    assert mean_batched_requests(its) == pytest.approx(16 / 3)  # the empty step is skipped
    assert mean_batched_requests(its, (1.0, 2.0)) == pytest.approx(3.0)
    shares = memory_shares(its, (1.0, None))
    assert shares["token_states"] == pytest.approx(6 / 16) and sum(
        shares.values()
    ) == pytest.approx(1)
    with pytest.raises(ValueError, match="window"):
        memory_shares(its, (10.0, 20.0))


def test_max_sustained_rate_interpolates_the_crossing():
    pts = [(1.0, 0.05), (2.0, 0.1), (3.0, 0.3)]
    assert max_sustained_rate(pts, 0.2) == pytest.approx(2.5)
    assert max_sustained_rate(pts, 1.0) == 3.0
    assert max_sustained_rate(pts, 0.01) == 0.0
    assert max_sustained_rate([(1.0, 0.05), (2.0, float("nan"))], 0.2) == 1.0
