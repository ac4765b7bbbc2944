"""Timing for the benchmarks: the interleaved fastest-of loop, a wall/CPU timer, and the
budget and deadlines that time-box a run."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def fastest_interleaved(
    systems: Mapping[str, Callable[[], tuple[float, T]]], repeats: int
) -> tuple[dict[str, float], dict[str, T]]:
    """Run each system once per round, rounds interleaved (so load on a shared machine falls
    on all of them alike); return each one's fastest seconds and its last output. A system is
    a callable returning (seconds, output), timing only what it measures."""
    best = dict.fromkeys(systems, float("inf"))
    outputs: dict[str, Any] = {}
    width = max(map(len, systems), default=0)
    for _ in range(repeats):
        for name, run in systems.items():
            seconds, outputs[name] = run()
            best[name] = min(best[name], seconds)
            print(f"{name:>{width}}: {seconds:.2f} s", flush=True)
    return best, outputs


def timed(fn: Callable[[], T]) -> Callable[[], tuple[float, T]]:
    """``fn`` as a system of :func:`fastest_interleaved`: its whole call is timed."""

    def run() -> tuple[float, T]:
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    return run


class Timer:
    """Wall-clock and process CPU seconds (all threads) spent inside a ``with`` block.

    CPU time is reported next to wall time because on a shared machine other processes'
    load stretches wall time a lot more than it stretches the CPU time a run needs.
    """

    def __init__(self) -> None:
        self.wall_s = self.cpu_s = 0.0

    def __enter__(self) -> Timer:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._wall
        self.cpu_s = time.process_time() - self._cpu


class Budget:
    """Wall-clock budget of a whole run."""

    def __init__(self, total_s: float) -> None:
        self.start = time.perf_counter()
        self.total_s = total_s

    def left(self) -> float:
        """Seconds left."""
        return self.total_s - (time.perf_counter() - self.start)


@dataclass
class Deadline:
    """The end of one section (or part of one): ``time.perf_counter()`` value."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now."""
        return cls(time.perf_counter() + seconds)

    @classmethod
    def never(cls) -> Deadline:
        """A deadline that does not come."""
        return cls(float("inf"))

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.at - time.perf_counter()
