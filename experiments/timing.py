"""The benchmarks' timing loop: every system run in turn, ``repeats`` rounds, fastest kept."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
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
