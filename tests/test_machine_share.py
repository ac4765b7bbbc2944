"""The lock that lets ``alone`` timing tests run with no other test beside them."""

from __future__ import annotations

import threading
import time

from machine_share import lock_dir, share_of_machine


def test_an_alone_test_waits_for_running_tests_and_holds_off_new_ones(tmp_path):
    order: list[str] = []
    first_in = threading.Event()
    release_first = threading.Event()

    def hold(name: str, alone: bool, until: threading.Event | None = None) -> None:
        with share_of_machine(tmp_path, alone):
            order.append(f"{name} in")
            if until is not None:
                first_in.set()
                until.wait(10)
            order.append(f"{name} out")

    first = threading.Thread(target=hold, args=("shared", False, release_first))
    first.start()
    assert first_in.wait(10)
    exclusive = threading.Thread(target=hold, args=("alone", True))
    exclusive.start()
    time.sleep(0.5)  # let it queue at the turnstile: a new shared test must now wait behind it
    late = threading.Thread(target=hold, args=("late", False))
    late.start()
    time.sleep(0.5)
    assert order == ["shared in"]  # neither started beside the running test
    release_first.set()
    for t in (first, exclusive, late):
        t.join(10)
    assert order == ["shared in", "shared out", "alone in", "alone out", "late in", "late out"]


def test_shared_tests_run_side_by_side(tmp_path):
    inside = threading.Barrier(2, timeout=10)  # both must be inside at once

    def hold() -> None:
        with share_of_machine(tmp_path, alone=False):
            inside.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not inside.broken


def test_the_hook_holds_the_lock_under_xdist_only(pytestconfig):
    directory = lock_dir(pytestconfig)
    assert (directory is None) == (not hasattr(pytestconfig, "workerinput"))
    if directory is not None:  # conftest's hook took this test's share before its setup
        assert (directory / "machine").exists() and (directory / "turnstile").exists()
