"""One deployment's capacity: the bracketing search on rate, each probe a simulated run per
seed of the configured workload at that rate (plain Python, no torch)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from experiments.capacity.rate_search import SLO, RateBound, RatePoint, bracket, judge, surely_fails
from paged_llm.workloads.arrivals import Workload, WorkloadSpec, build_workload


@dataclass(frozen=True)
class RateSearch:
    """The bracketing search's settings (the ``rate_search`` config node). ``early_fraction``:
    each probe first simulates this share of the arrival span and stops there when the TTFT
    SLO is already lost for the whole run (0: always simulate whole runs)."""

    start: float = 1.0
    floor: float = 0.05
    ceiling: float = 256.0
    growth: float = 2.0
    rel_tol: float = 0.05
    early_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not 0 <= self.early_fraction < 1:
            raise ValueError(f"early_fraction must be in [0, 1), got {self.early_fraction}")


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
    early_fraction: float = 0.25
    iterations: int = 0
    requests: int = 0
    seconds: float = 0.0

    def workloads(self, rate: float) -> list[Workload]:
        """The workload at ``rate``, once per seed."""
        return [build_workload(WorkloadSpec(**{**self.workload, "seed": s, "request_rate": rate}))
                for s in self.seeds]  # fmt: skip

    def _run(self, w: Workload, stop_time: float | None) -> Any:
        t0 = time.process_time()
        trace = self.executor.run(w, self.policy, self.settings, stop_time=stop_time,
                                  memory_every=0)  # fmt: skip
        self.seconds += time.process_time() - t0
        self.iterations += len(trace.iterations)
        self.requests += sum(r.arrival_time <= trace.end_time for r in trace.requests)
        return trace

    def __call__(self, rate: float) -> RatePoint:
        """The SLO verdict at ``rate``: an early stop when the runs' first part already fails."""
        loads = self.workloads(rate)
        if self.early_fraction:
            stops = [self.early_fraction * max(r.arrival_time for r in w.requests) for w in loads]
            early = [self._run(w, t) for w, t in zip(loads, stops)]
            if surely_fails(early, [len(w.requests) for w in loads], self.slo):
                point = judge(early, rate, self.slo)
                point.meets, point.early_stop = False, True
                return point
        return judge([self._run(w, None) for w in loads], rate, self.slo)

    def speed(self) -> dict[str, float]:
        """Simulated iterations and requests per CPU second of the simulator."""
        s = self.seconds or float("nan")
        return {"sim_cpu_s": self.seconds, "iterations": self.iterations,
                "requests": self.requests, "iterations_per_s": self.iterations / s,
                "requests_per_s": self.requests / s}  # fmt: skip


def capacity(prober: Prober, search: RateSearch) -> RateBound:
    """The highest rate within the SLOs (or a bound), by ``bracket``."""
    return bracket(prober, search.start, search.floor, search.ceiling, search.growth,
                   search.rel_tol)  # fmt: skip
