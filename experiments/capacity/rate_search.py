"""The highest request rate a deployment sustains within its SLOs: each probed rate is a
simulated run per seed (the requests of all seeds pooled), and a bracketing search on the
rate (grow until a rate fails, then bisect) finds where the SLOs stop holding. A search that
never crosses reports a bound, not a number. Plain Python."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from paged_llm.metrics.serving import RequestRecord, RunTrace


@dataclass(frozen=True)
class SLO:
    """Latency targets: the ``ttft_percentile``-th TTFT and ``tpot_percentile``-th TPOT
    (time per output token after the first) in milliseconds, over all requests."""

    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0
    ttft_percentile: float = 90.0
    tpot_percentile: float = 99.0

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO targets must be > 0 ms, got {self.ttft_ms}, {self.tpot_ms}")
        for q in (self.ttft_percentile, self.tpot_percentile):
            if not 0 < q <= 100:
                raise ValueError(f"SLO percentiles must be in (0, 100], got {q}")


def ttft_s(r: RequestRecord, now: float) -> float:
    """Time to first token; a request still waiting at ``now`` has waited at least this."""
    end = r.first_token_time if r.first_token_time is not None else now
    return end - r.arrival_time


def tpot_s(r: RequestRecord) -> float | None:
    """Time per output token after the first (vLLM's TPOT); None until the request finished."""
    if r.finished_time is None or r.first_token_time is None or r.output_len < 2:
        return None
    return (r.finished_time - r.first_token_time) / (r.output_len - 1)


def _within(r: RequestRecord, slo: SLO) -> bool:
    tpot = tpot_s(r)
    ok_tpot = tpot is None or 1000 * tpot <= slo.tpot_ms
    return r.finished and 1000 * ttft_s(r, math.inf) <= slo.ttft_ms and ok_tpot


@dataclass
class RatePoint:
    """What the runs at one rate measured (all seeds pooled)."""

    rate: float
    meets: bool
    ttft_ms: float  # the SLO's TTFT percentile (inf: a request never got a token)
    tpot_ms: float  # the SLO's TPOT percentile
    attainment: float  # share of requests that finished within both targets
    request_throughput: float  # completed requests per second, mean over seeds
    num_requests: int
    early_stop: bool = False  # failed on the runs' first part (the rest was not simulated)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for result files."""
        return asdict(self)


def judge(traces: Sequence[RunTrace], rate: float, slo: SLO) -> RatePoint:
    """Pool the requests of complete runs and compare the percentiles with the SLO (a request
    that never finished counts as infinitely late)."""
    reqs = [r for t in traces for r in t.requests]
    ttft = [ttft_s(r, math.inf) for r in reqs]
    tpot = [math.inf if not r.finished else tpot_s(r) for r in reqs]
    p_ttft = 1000 * percentile_inf(ttft, slo.ttft_percentile)
    p_tpot = 1000 * percentile_inf([t for t in tpot if t is not None], slo.tpot_percentile)
    thr = [_throughput(t) for t in traces]
    return RatePoint(
        rate, p_ttft <= slo.ttft_ms and p_tpot <= slo.tpot_ms, p_ttft, p_tpot,
        sum(_within(r, slo) for r in reqs) / len(reqs), sum(thr) / len(thr), len(reqs),
    )  # fmt: skip


def percentile_inf(values: list[float], q: float) -> float:
    """``percentile`` where values may be infinite (unfinished requests): inf as soon as the
    interpolation reaches one; 0 for no values (no request had a TPOT)."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), min(math.floor(pos) + 1, len(xs) - 1)
    if math.isinf(xs[lo]) or (math.isinf(xs[hi]) and pos > lo):
        return math.inf
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo) if pos > lo else xs[lo]


def _throughput(trace: RunTrace) -> float:
    done = [r.finished_time for r in trace.requests if r.finished_time is not None]
    return len(done) / max(done) if done else 0.0


def late_requests(trace: RunTrace, slo: SLO) -> tuple[int, int]:
    """Requests of a run (complete, or stopped at ``end_time``) already over a target, for
    good: (TTFT over it: a request still waiting has waited at least until the run's end,
    finished requests whose TPOT is over it)."""
    end, ttft, tpot = trace.end_time, 0, 0
    for r in trace.requests:
        if r.arrival_time <= end:
            ttft += 1000 * ttft_s(r, end) > slo.ttft_ms
            t = tpot_s(r)
            tpot += t is not None and 1000 * t > slo.tpot_ms
    return ttft, tpot


def fail_count(total: int, percentile: float) -> int:
    """The fewest values over a target among ``total`` that put the ``percentile`` over it
    whatever the others are: ``percentile_inf`` reads the sorted values at index
    floor((total - 1) q / 100) and above, so that many from the top must be over."""
    return total - math.floor((total - 1) * percentile / 100.0)


def fail_counts(workloads: Sequence[Any], slo: SLO) -> tuple[int, int]:
    """``fail_count`` of the TTFT and of the TPOT percentile over the pooled requests of
    these workloads (TPOT: the requests of two or more output tokens, those ``judge`` counts)."""
    reqs = [r for w in workloads for r in w.requests]
    with_tpot = sum(r.output_len >= 2 for r in reqs)
    return fail_count(len(reqs), slo.ttft_percentile), fail_count(with_tpot, slo.tpot_percentile)


@dataclass
class RateBound:
    """The search's answer: ``rate`` is the highest rate that met the SLOs (``kind`` exact:
    the next probed rate, ``upper``, failed; at_least: no probed rate up to the search's
    ceiling failed; below: even the floor ``upper`` failed, ``rate`` is 0; pruned: a
    branch-and-bound search needed ``upper`` to beat its best and a probe there failed;
    pruned_bound: the same, decided by a lower bound on the busy time, not simulated)."""

    rate: float
    upper: float | None
    kind: str
    points: list[RatePoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for result files."""
        return {"rate": self.rate, "upper": self.upper, "kind": self.kind,
                "points": [p.to_dict() for p in self.points]}  # fmt: skip

    def text(self) -> str:
        """The rate as a table cell: a number, or a bound."""
        return TEXT[self.kind](self)


TEXT = {  # how each kind of answer reads in a table
    "exact": lambda b: f"{b.rate:.3g}",
    "at_least": lambda b: f">= {b.rate:.3g}",
    "below": lambda b: f"< {b.upper:.3g}",
    "pruned": lambda b: f"< {b.upper:.3g}",
    "pruned_bound": lambda b: f"< {b.upper:.3g} (bound)",
}


def bracket(
    probe: Callable[[float], RatePoint], start: float, floor: float, ceiling: float,
    growth: float = 2.0, rel_tol: float = 0.05, first_step: float | None = None,
) -> RateBound:  # fmt: skip
    """Grow (or shrink) the rate from ``start`` until the SLOs' outcome flips, then bisect
    geometrically until the passing and failing rates are within ``rel_tol``. The first step
    is the factor ``first_step`` (None: ``growth``), and each next one the last squared, up to
    ``growth``: a good ``start`` costs few probes, a bad one a few more. Assumes a deployment
    that fails at a rate fails at every higher one."""
    step = growth if first_step is None else first_step
    if not 0 < floor <= start <= ceiling or not 1 < step <= growth or rel_tol <= 0:
        raise ValueError(
            "need 0 < floor <= start <= ceiling, growth > 1, 1 < first_step <= growth and "
            "rel_tol > 0"
        )
    points: list[RatePoint] = []

    def meets(rate: float) -> bool:
        points.append(probe(rate))
        return points[-1].meets

    lo, hi, rate = None, None, start
    if meets(rate):
        lo = rate
        while hi is None:
            if lo >= ceiling:
                return RateBound(lo, None, "at_least", points)
            rate, step = min(lo * step, ceiling), min(step * step, growth)
            lo, hi = (rate, None) if meets(rate) else (lo, rate)
    else:
        hi = rate
        while lo is None:
            if hi <= floor:
                return RateBound(0.0, hi, "below", points)
            rate, step = max(hi / step, floor), min(step * step, growth)
            lo, hi = (rate, hi) if meets(rate) else (None, rate)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return RateBound(lo, hi, "exact", points)
