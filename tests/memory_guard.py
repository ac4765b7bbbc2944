"""Free the engines that tests leave in reference cycles before the workers run out of memory.

An ``LLM`` dropped at the end of a test sits in a reference cycle (engine, runner, plug-ins)
with its KV cache, ~1 GB, until Python's full collection, which a test process rarely
reaches: in a full run (2026-12-06) one worker grew to 12.8 GB by ``tests/test_lora.py``
and, in a fresh clone, another to 16 GB, killed for memory. ``gc.collect()`` frees them
(1.5 -> 0.5 GB) but costs ~0.3 s, too much after each of ~1,500 tests, so a test's end
collects only once the process has grown ``GROWTH`` since the last collection.
"""

from __future__ import annotations

import gc
import os

GROWTH = 1.5 * 2**30  # bytes of growth since the last collection that trigger the next one


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class MemoryGuard:
    """Collects garbage when the resident memory grew ``growth`` bytes past its last level."""

    def __init__(self, growth: float = GROWTH, measure=resident_bytes) -> None:
        self.growth, self.measure = growth, measure
        self.level = measure()  # after the last collection (or at the start)
        self.collections = 0

    def after_test(self) -> bool:
        """Collect if due; say whether it did."""
        if self.measure() - self.level < self.growth:
            return False
        gc.collect()
        self.level = self.measure()
        self.collections += 1
        return True


GUARD = MemoryGuard()


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    """After each test's teardown (its fixtures' too)."""
    GUARD.after_test()
