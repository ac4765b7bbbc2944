"""Kernel timing on the device: median seconds per call, optionally replayed from a CUDA graph."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(
    fn: Callable[[], Any], device: torch.device, reps: int, inner: int = 0, graph: bool = False
) -> float:
    """Median seconds per call of ``fn`` (after a warm-up), over ``reps`` timed groups.

    ``graph=True`` (CUDA) captures the group's calls in one CUDA graph and times its replays,
    so a kernel's time excludes Python's launch overhead (tens of microseconds for a Triton
    launch, more than many decode kernels take); eager timing is the fallback if capture fails.
    """
    fn()
    sync(device)
    if inner <= 0:  # enough calls per group to time ~20 ms of work
        start = time.perf_counter()
        fn()
        sync(device)
        inner = max(1, min(100, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    run = lambda: [fn() for _ in range(inner)]  # noqa: E731
    if device.type == "cuda" and graph:
        try:
            run = _captured(fn, inner).replay
        except Exception as err:  # recorded in the log; eager timing still measures something
            print(f"[gpu_check] CUDA graph capture failed, timing eagerly: {err}", flush=True)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3 / inner)
        else:
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _captured(fn: Callable[[], Any], calls: int) -> Any:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph
