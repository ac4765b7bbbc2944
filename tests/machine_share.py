"""Timing tests run alone on the machine, even under ``pytest -n 2``.

A test marked ``alone`` compares times measured at different moments (a calibration grid, then
a real run priced by it). On the 2-core CI machine the other pytest worker's load, say a test
that starts four tensor-parallel processes, slows the later measurement and not the earlier
one (runs 2026-12-06: 26% and 70% error against 2-10% alone). So every test holds a shared lock
from its setup to its teardown (module fixtures included), and an ``alone`` test an exclusive
one. A turnstile lock in front keeps the exclusive waiter from starving: once it is queued, no
new test starts beside it. Without xdist the tests already run one at a time: nothing to lock.
"""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def lock_dir(config: pytest.Config) -> Path | None:
    """Where this run's workers share their locks (None without xdist)."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return None
    return Path(tempfile.gettempdir()) / f"paged-llm-tests-{worker['testrunuid']}"


@contextmanager
def share_of_machine(directory: Path, alone: bool) -> Iterator[None]:
    """Hold the machine: exclusively if ``alone``, else beside other tests."""
    directory.mkdir(exist_ok=True)
    with open(directory / "turnstile", "a") as turnstile, open(directory / "machine", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # queue behind a waiting exclusive test
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Run each test's setup, call and teardown under its share of the machine."""
    directory = lock_dir(item.config)
    if directory is None:
        yield
        return
    with share_of_machine(directory, item.get_closest_marker("alone") is not None):
        yield
