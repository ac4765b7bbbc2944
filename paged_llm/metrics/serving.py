"""vLLM's serving-benchmark metrics and the paper's (normalized latency, batched requests, the
Fig. 2 memory breakdown), computed from per-request and per-iteration records that real and
simulated runs both produce (plain Python, no torch)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.kv.base import MemoryBreakdown

SHARE_KEYS = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation")


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds from the start of the run."""

    request_id: str
    input_len: int
    output_len: int  # the trace's output length (what it must generate)
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        """True when the request generated all its tokens within the run."""
        return self.finished_time is not None

    @property
    def e2e_latency(self) -> float:
        """Arrival to last token, seconds."""
        assert self.finished_time is not None
        return self.finished_time - self.arrival_time


@dataclass
class IterationRecord:
    """One engine step: when it started, how long it took, what it batched, the KV pool split."""

    time: float
    duration: float
    num_running: int  # requests in the batch (running after this step's scheduling)
    num_batched_tokens: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    num_preemptions: int
    memory: MemoryBreakdown | None = None


@dataclass
class RunTrace:
    """Everything one real or simulated run produced, plus what it ran on."""

    requests: list[RequestRecord]
    iterations: list[IterationRecord]
    end_time: float  # run clock when the run stopped
    mode: str  # "real" or "simulated"
    hardware: str  # e.g. "simulated OPT-13B on 1x A100-40GB" or "CPU: AMD EPYC (2 cores)"
    policy: str
    num_kv_blocks: int
    block_size: int
    wall_time_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


# ---- statistics ---------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile with linear interpolation (numpy's default); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(values_s: Sequence[float], prefix: str) -> dict[str, float]:
    """mean / median / p99 of seconds, reported in ms as vLLM's benchmark does."""
    if not values_s:
        return {
            f"mean_{prefix}_ms": math.nan,
            f"median_{prefix}_ms": math.nan,
            f"p99_{prefix}_ms": math.nan,
        }
    return {
        f"mean_{prefix}_ms": 1000 * sum(values_s) / len(values_s),
        f"median_{prefix}_ms": 1000 * percentile(values_s, 50),
        f"p99_{prefix}_ms": 1000 * percentile(values_s, 99),
    }


def serving_metrics(trace: RunTrace) -> dict[str, Any]:
    """vLLM's benchmark_serving metrics plus the paper's normalized latency."""
    done = [r for r in trace.requests if r.finished]
    duration = max((r.finished_time for r in done), default=0.0) or trace.end_time
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.input_len for r in done)
    return {
        "num_requests": len(trace.requests),
        "completed": len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else math.nan,
        "output_throughput": out_tokens / duration if duration else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else math.nan,
        **latency_summary(done),
        "normalized_latency": normalized_latency(done),
        "num_preemptions": sum(r.num_preemptions for r in trace.requests),
    }


def latency_summary(done: Sequence[RequestRecord]) -> dict[str, float]:
    """TTFT, TPOT, ITL and E2EL of finished requests (mean / median / p99, ms), as vLLM's
    benchmark computes them from each request's token times."""
    ttft = [r.first_token_time - r.arrival_time for r in done if r.first_token_time is not None]
    tpot = [
        (r.finished_time - r.first_token_time) / (r.output_len - 1)
        for r in done
        if r.output_len > 1 and r.first_token_time is not None
    ]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    e2el = [r.e2e_latency for r in done]
    return {**summary_ms(ttft, "ttft"), **summary_ms(tpot, "tpot"), **summary_ms(itl, "itl"),
            **summary_ms(e2el, "e2el")}  # fmt: skip


def normalized_latency(requests: Iterable[RequestRecord]) -> float:
    """The paper's metric: mean over finished requests of e2e latency / output length (s/token)."""
    vals = [r.e2e_latency / r.output_len for r in requests if r.finished and r.output_len > 0]
    return sum(vals) / len(vals) if vals else math.nan


def _in_window(
    iterations: Iterable[IterationRecord], window: tuple[float | None, float | None] | None
) -> list[IterationRecord]:
    lo, hi = window if window is not None else (None, None)
    return [
        it for it in iterations if (lo is None or it.time >= lo) and (hi is None or it.time <= hi)
    ]


def mean_batched_requests(
    iterations: Iterable[IterationRecord], window: tuple[float | None, float | None] | None = None
) -> float:
    """Mean number of requests in a batch over the iterations in ``window`` (Fig. 13)."""
    its = [it for it in _in_window(iterations, window) if it.num_batched_tokens > 0]
    return sum(it.num_running for it in its) / len(its) if its else math.nan


def memory_shares(
    iterations: Iterable[IterationRecord], window: tuple[float | None, float | None] | None = None
) -> dict[str, float]:
    """Fig. 2: each part of the KV pool as a fraction, averaged over the iterations in
    ``window`` (per-iteration mean, as the artifact's plot does)."""
    its = [it for it in _in_window(iterations, window) if it.memory is not None]
    if not its:
        raise ValueError(f"no iteration with a memory breakdown in window {window}")
    sums = dict.fromkeys(SHARE_KEYS, 0.0)
    for it in its:
        for k, v in it.memory.shares().items():
            sums[k] += v
    return {k: v / len(its) for k, v in sums.items()}


def max_sustained_rate(points: Sequence[tuple[float, float]], threshold: float) -> float:
    """Highest request rate whose normalized latency stays <= ``threshold``, interpolated
    linearly to where the curve crosses it; 0 if even the lowest rate is above it."""
    pts = sorted(points)
    best = 0.0
    for (r0, l0), (r1, l1) in zip([(0.0, 0.0), *pts], pts):
        if not l1 <= threshold:  # nan counts as not sustained
            if l0 <= threshold and r0 > 0 and l1 > l0:
                best = r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
            return best
        best = r1
    return best
