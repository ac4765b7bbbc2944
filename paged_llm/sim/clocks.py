"""Clocks for real runs: wall time, or the engine process's own CPU time (plain Python).

A real run on a shared CPU competes with other tenants: wall-clock arrivals then meet a
server slowed by someone else's load, and no simulator can predict that. The process clock
counts only the CPU seconds this process ran, so arrivals, step durations and latencies are
what the same run would show on an idle machine (up to shared caches and SMT siblings). It
is wrong on a GPU, where the process waits for the device without running, hence ``auto``.
"""

from __future__ import annotations

import time


class WallClock:
    """Monotonic wall time; waiting sleeps."""

    name = "wall"

    def now(self) -> float:
        """Seconds since an arbitrary start."""
        return time.monotonic()

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        time.sleep(max(0.0, seconds))


class ProcessClock:
    """This process's CPU seconds; waiting (an idle server) skips ahead instead of sleeping,
    as idle CPU time would never pass."""

    name = "process"

    def __init__(self) -> None:
        self.skipped = 0.0

    def now(self) -> float:
        """CPU seconds of this process plus the idle time skipped."""
        return time.process_time() + self.skipped

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass (at once)."""
        self.skipped += max(0.0, seconds)


CLOCKS = {"wall": WallClock, "process": ProcessClock}
# ``auto`` by device type: the CPU's own time on a CPU, wall time where a device computes.
AUTO_CLOCK = {"cpu": "process"}


def make_clock(name: str, device_type: str) -> WallClock | ProcessClock:
    """The clock ``name`` (``auto``: by the device the engine runs on)."""
    if name == "auto":
        name = AUTO_CLOCK.get(device_type, "wall")
    if name not in CLOCKS:
        raise ValueError(f"unknown clock '{name}'; choose auto or one of {list(CLOCKS)}")
    return CLOCKS[name]()
