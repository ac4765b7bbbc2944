"""Where each job of a multirun ran and who shared the machine with it: every job pins its torch
threads to its share of the host's cores and writes ``sweep_job.json`` (host, threads, start and
end); the merge counts, per job, the jobs that ran on the same host at the same time."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
RECORD = "sweep_job.json"


def host_cores() -> int:
    """The cores this process may run on (its affinity mask: a Slurm allocation's CPUs)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _joblib(launcher: Mapping[str, Any], n_jobs: int) -> int:
    """joblib's n_jobs processes (-1: one per core, -2: all but one, ...)."""
    n = int(launcher.get("n_jobs") or -1)
    return max(1, host_cores() + 1 + n if n < 0 else n)


def _all_at_once(launcher: Mapping[str, Any], n_jobs: int) -> int:
    """Every job at once, up to the launcher's array_parallelism (submitit local, Ray local)."""
    return max(1, min(n_jobs, int(launcher.get("array_parallelism") or n_jobs)))


# How many jobs run at once on one host, per launcher (the rest: one job at a time, as the basic
# launcher; a Slurm job sees only its own allocation's cores).
JOBS_AT_ONCE: dict[str, Callable[[Mapping[str, Any], int], int]] = {
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher": _joblib,
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher": _all_at_once,
    "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher": _all_at_once,
}


def jobs_at_once(launcher: Mapping[str, Any], n_jobs: int) -> int:
    """How many of the sweep's ``n_jobs`` jobs the launcher runs at once on one host."""
    rule = JOBS_AT_ONCE.get(str(launcher.get("_target_")))
    return min(n_jobs, rule(launcher, n_jobs)) if rule else 1


def busy_cores() -> float:
    """Cores other processes keep busy: the 1-minute load average less this job's own one."""
    return max(0.0, os.getloadavg()[0] - 1.0) if hasattr(os, "getloadavg") else 0.0


def threads_per_job(at_once: int, fixed: int | None = None) -> int:
    """The torch threads a job gets: ``fixed``, else its share of the host's cores, and no more
    than the cores others leave free (more threads than free cores stall OpenMP's barriers,
    10-30x slower matmuls on a shared 2-core machine: configs/throughput.yaml)."""
    if fixed:
        return int(fixed)
    share = host_cores() // max(1, at_once)
    return max(1, min(share, int(host_cores() - busy_cores())))


def start_job(job_dir: Path, at_once: int, threads: int) -> dict[str, Any]:
    """Pin this job's torch threads, warn when jobs share the cores, and record the job."""
    os.environ["OMP_NUM_THREADS"] = str(threads)  # torch reads it when first imported
    torch = sys.modules.get("torch")  # a simulated figure need not import torch at all
    if torch is not None:
        torch.set_num_threads(threads)
    cores = host_cores()
    if at_once > 1:
        log.warning(
            "%d jobs run at once on %s (%d cores, %d threads each): timings are of a shared "
            "machine; the merged table's jobs_on_host says how many overlapped",
            at_once, socket.gethostname(), cores, threads,
        )  # fmt: skip
    busy = busy_cores()
    if busy >= 1.0:
        log.warning(
            "other processes keep ~%.1f of %s's %d cores busy: this job runs %d thread(s), and "
            "its timings are of a shared machine", busy, socket.gethostname(), cores, threads,
        )  # fmt: skip
    record = {
        "host": socket.gethostname(), "pid": os.getpid(), "cores": cores, "threads": threads,
        "jobs_at_once": at_once, "busy_cores_at_start": round(busy, 2),
        "start": time.time(), "end": None,
    }  # fmt: skip
    (job_dir / RECORD).write_text(json.dumps(record))
    return record


def end_job(job_dir: Path) -> None:
    """Stamp the job's end time into its record."""
    path = job_dir / RECORD
    if path.is_file():
        record = json.loads(path.read_text())
        record["end"] = time.time()
        path.write_text(json.dumps(record))


def read_record(job_dir: Path) -> dict[str, Any]:
    """A job's record (empty when the job ran without the callback)."""
    path = job_dir / RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def jobs_on_host(records: list[dict[str, Any]]) -> list[int | None]:
    """Per job, how many jobs (itself included) ran on its host while it ran."""
    now = time.time()  # a job without an end is still running (or died)
    spans = [
        (r["host"], r["start"], now if r.get("end") is None else r["end"])
        if r.get("start") is not None else None
        for r in records
    ]  # fmt: skip
    return [
        None if s is None
        else sum(1 for o in spans if o and o[0] == s[0] and o[1] < s[2] and o[2] > s[1])
        for s in spans
    ]  # fmt: skip
