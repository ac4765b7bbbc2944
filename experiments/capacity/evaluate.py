"""One deployment's capacity: the bracketing search on rate, each probe a simulated run per
seed of the configured workload at that rate (plain Python, no torch)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from experiments.capacity.bound import busy_time_lower_bound
from experiments.capacity.rate_search import (
    SLO,
    RateBound,
    RatePoint,
    bracket,
    fail_counts,
    judge,
    late_requests,
)
from paged_llm.sim.executor import RunCheck
from paged_llm.workloads.arrivals import Workload, WorkloadSpec, build_workload


@dataclass(frozen=True)
class RateSearch:
    """The bracketing search's settings (the ``rate_search`` config node). ``early_fraction``:
    each probe's runs are looked at every this share of their arrival span and stop there
    once the TTFT SLO is lost for the whole probe, whatever the rest would do (0: always
    simulate whole runs). ``first_guess``: start at this share of the deployment's
    ``bound_rate`` (None: at ``start``). ``first_step``: the first
    step's factor from there (None: 1 + ``rel_tol`` from a guess, ``growth`` from ``start``).
    ``must_beat``: requests per dollar the deployment must beat to matter (a branch-and-bound
    sweep passes the best so far; None: search every deployment whole); one that cannot is
    pruned, by ``bound.busy_time_lower_bound`` (more than ``bound_margin`` over the arrival
    span at the rate it needs) or by one failing probe at that rate."""

    start: float = 1.0
    floor: float = 0.05
    ceiling: float = 256.0
    growth: float = 2.0
    rel_tol: float = 0.05
    early_fraction: float = 0.1
    first_guess: float | None = 0.9
    first_step: float | None = None
    must_beat: float | None = None
    bound_margin: float = 0.05

    def __post_init__(self) -> None:
        if self.must_beat is not None and self.must_beat < 0:
            raise ValueError(f"must_beat must be >= 0 requests per dollar, got {self.must_beat}")
        if self.bound_margin < 0:
            raise ValueError(f"bound_margin must be >= 0, got {self.bound_margin}")
        if not 0 <= self.early_fraction < 1:
            raise ValueError(f"early_fraction must be in [0, 1), got {self.early_fraction}")
        if self.first_guess is not None and self.first_guess <= 0:
            raise ValueError(f"first_guess must be > 0 (or null), got {self.first_guess}")
        if not 1 < self.step <= self.growth:
            raise ValueError(f"first_step must be in (1, growth={self.growth}], got {self.step}")

    @property
    def step(self) -> float:
        """The first step's factor, the default filled in."""
        if self.first_step is not None:
            return self.first_step
        return min(1 + self.rel_tol, self.growth) if self.first_guess else self.growth


@dataclass
class Prober:
    """Probes a deployment (its executor, policy and settings) at a rate over the seeds;
    counts the simulated iterations and requests and the CPU seconds they took (process
    time: on a shared machine the wall clock also counts the other tenants' work)."""

    executor: Any
    policy: str
    settings: Any
    workload: Mapping[str, Any]  # WorkloadSpec fields
    seeds: list[int]
    slo: SLO
    early_fraction: float = 0.1
    iterations: int = 0
    requests: int = 0
    seconds: float = 0.0
    probed: dict[float, RatePoint] = field(default_factory=dict)  # rate -> its verdict
    _least_busy: dict[float, list[tuple[float, float, int]]] = field(
        default_factory=dict, init=False, repr=False
    )

    def workloads(self, rate: float) -> list[Workload]:
        """The workload at ``rate``, once per seed."""
        return [build_workload(WorkloadSpec(**{**self.workload, "seed": s, "request_rate": rate}))
                for s in self.seeds]  # fmt: skip

    def _run(self, w: Workload, check: RunCheck | None) -> Any:
        t0 = time.process_time()
        trace = self.executor.run(w, self.policy, self.settings, memory_every=0, check=check)
        self.seconds += time.process_time() - t0
        self.iterations += len(trace.iterations)
        self.requests += sum(r.arrival_time <= trace.end_time for r in trace.requests)
        return trace

    def __call__(self, rate: float) -> RatePoint:
        """The SLO verdict at ``rate`` (a rate probed before is not run again)."""
        if rate not in self.probed:
            self.probed[rate] = self._probe(rate)
        return self.probed[rate]

    def least_busy(self, rate: float) -> list[tuple[float, float, int]]:
        """Per seed, for the workload at ``rate``: the least busy time any schedule needs to
        serve it (bound.busy_time_lower_bound, no simulation), its arrival span and its
        number of requests; computed once per rate."""
        if rate not in self._least_busy:
            s = self.settings
            cost = self.executor.cost_model(s.block_size)
            self._least_busy[rate] = [
                (busy_time_lower_bound(cost, s, s.num_gpu_blocks, w.requests),
                 max(r.arrival_time for r in w.requests), len(w.requests))
                for w in self.workloads(rate)
            ]  # fmt: skip
        return self._least_busy[rate]

    def busy_share(self, rate: float) -> float:
        """The least busy time of the workload at ``rate`` as a share of its arrival span (the
        largest over the seeds): above 1, requests arrive faster than they can be served. 0
        with prefix caching, whose shared prompts the bound does not count."""
        if self.settings.enable_prefix_caching:
            return 0.0
        return max(busy / span for busy, span, _ in self.least_busy(rate))

    def _probe(self, rate: float) -> RatePoint:
        """The seeds' runs at ``rate`` one after another; with
        ``early_fraction``, stopped (with the seeds left) as soon as enough requests are over
        the TTFT or the TPOT target that its percentile is lost whatever the rest do (exact
        counts, rate_search.fail_counts), then judged on what ran and marked ``early_stop``."""
        loads = self.workloads(rate)
        needed = fail_counts(loads, self.slo)
        traces: list[Any] = []
        late = (0, 0)
        for w in loads:
            traces.append(self._run(w, self._check(w, late, needed)))
            late = _add(late, late_requests(traces[-1], self.slo))
            if _lost(late, needed) and self.early_fraction:
                break
        point = judge(traces, rate, self.slo)
        cut = len(traces) < len(loads) or any(
            r.finished_time is None for t in traces for r in t.requests
        )  # a whole run finishes every request
        if _lost(late, needed):
            point.meets, point.early_stop = False, cut
        return point

    def _check(
        self, w: Workload, before: tuple[int, int], needed: tuple[int, int]
    ) -> RunCheck | None:
        """Looks at the run every ``early_fraction`` of its arrival span: stop once the late
        requests of the seeds before and of this run so far lose an SLO."""
        if not self.early_fraction:
            return None
        span = max(r.arrival_time for r in w.requests)
        times = [k * self.early_fraction * span
                 for k in range(1, math.ceil(1 / self.early_fraction))]  # fmt: skip
        return RunCheck(times, lambda t: _lost(_add(before, late_requests(t, self.slo)), needed))

    def speed(self) -> dict[str, float]:
        """Simulated iterations and requests per CPU second of the simulator."""
        s = self.seconds or float("nan")
        return {"sim_cpu_s": self.seconds, "iterations": self.iterations,
                "requests": self.requests, "iterations_per_s": self.iterations / s,
                "requests_per_s": self.requests / s}  # fmt: skip


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _lost(late: tuple[int, int], needed: tuple[int, int]) -> bool:
    """Enough late requests (TTFT, TPOT) to lose either percentile."""
    return late[0] >= needed[0] or late[1] >= needed[1]


def bound_rate(prober: Prober, rate: float) -> float:
    """The rate at which the least busy time of the (first seed's) workload at ``rate`` would
    fill its arrival span (``Prober.least_busy``): requests arriving faster than this outrun
    any schedule (up to the lengths drawn at ``rate``)."""
    busy, _, num_requests = prober.least_busy(rate)[0]
    return num_requests / busy


def start_rate(prober: Prober, search: RateSearch) -> float:
    """The search's first rate: ``first_guess`` times the deployment's ``bound_rate`` (within
    floor and ceiling), or the fixed ``start``."""
    if not search.first_guess:
        return search.start
    guess = search.first_guess * bound_rate(prober, search.start)
    return min(max(guess, search.floor), search.ceiling)


def capacity(prober: Prober, search: RateSearch, needed: float | None = None) -> RateBound:
    """The highest rate within the SLOs (or a bound), by ``bracket`` from ``start_rate``.
    With ``needed`` (the rate at which the deployment would match the best so far), a
    deployment that cannot reach it is pruned (kind ``pruned_bound``: the busy-time bound
    says so; ``pruned``: a probe at ``needed`` failed); one that can is bracketed from there
    up, the passing probe at ``needed`` its floor."""
    floor, start = search.floor, start_rate(prober, search)
    if needed is not None and needed > search.floor:
        if prober.busy_share(needed) > 1 + search.bound_margin:
            return RateBound(0.0, needed, "pruned_bound", [])
        at_needed = prober(needed)
        if not at_needed.meets:
            return RateBound(0.0, needed, "pruned", [at_needed])
        floor, start = needed, max(start, needed)
    found = bracket(prober, start, floor, max(search.ceiling, start), search.growth,
                    search.rel_tol, search.step)  # fmt: skip
    if needed in prober.probed and all(p.rate != needed for p in found.points):
        found.points.insert(0, prober.probed[needed])  # the probe that let it in, run first
    return found
