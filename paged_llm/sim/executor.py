"""The simulated executor: the real Scheduler and KV manager, a virtual clock, and each
iteration's duration from the cost model instead of a GPU (plain Python, no torch)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paged_llm.core.request import Request
from paged_llm.core.scheduler import SchedulerOutput
from paged_llm.metrics.serving import IterationRecord, RequestRecord, RunTrace
from paged_llm.sampling_params import SamplingParams
from paged_llm.sim.calibration import calibrate
from paged_llm.sim.cost_model import RooflineCostModel, StepShape
from paged_llm.sim.hardware import GPUSpec, get_hardware
from paged_llm.sim.model_shapes import ModelShape, get_model_shape
from paged_llm.sim.settings import ServingSettings, build_scheduler
from paged_llm.workloads.arrivals import Workload

GiB = 2**30
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def resolve_config_path(path: str) -> str:
    """A path as given if it exists, else relative to the repository's ``configs/``."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute() or not (CONFIG_DIR / p).exists():
        return str(p)
    return str(CONFIG_DIR / p)


def step_shape(out: SchedulerOutput, block_size: int) -> StepShape:
    """Sum what the scheduled requests compute and read this step."""
    new = kv = blocks = pairs = 0
    for s in out.scheduled:
        n = s.num_new_tokens
        before = s.request.num_computed_tokens
        ctx = before + n
        new += n
        kv += ctx
        blocks += -(-ctx // block_size)
        pairs += n * before + n * (n + 1) // 2
    return StepShape(
        len(out.scheduled), new, kv, blocks, pairs, len(out.swap_in) + len(out.swap_out)
    )


class SimulatedExecutor:
    """Runs a workload through the scheduler on a virtual clock priced by a cost model."""

    mode = "simulated"

    def __init__(
        self,
        hardware: GPUSpec | str | Mapping[str, Any] = "a100-40gb",
        model: ModelShape | str | Mapping[str, Any] = "opt-13b",
        num_gpus: int | None = None,
        cost: Mapping[str, Any] | None = None,
        calibration: str | None = None,
    ) -> None:
        """``hardware`` / ``model``: a preset name, an object, or a mapping ``{name: preset,
        **field overrides}`` as the ``hardware`` and ``model_shape`` config groups give it (the
        hardware mapping may carry ``num_gpus``)."""
        hw = dict(hardware) if isinstance(hardware, Mapping) else {"name": hardware}
        gpus = hw.pop("num_gpus", 1)
        self.num_gpus = int(num_gpus if num_gpus is not None else gpus)
        name = hw.pop("name")
        self.hardware = name if isinstance(name, GPUSpec) else get_hardware(name, **hw)
        m = dict(model) if isinstance(model, Mapping) else {"name": model}
        name = m.pop("name")
        self.model = name if isinstance(name, ModelShape) else get_model_shape(name, **m)
        self.cost = dict(cost or {})
        self.calibration = resolve_config_path(calibration) if calibration else None

    def cost_model(self, block_size: int) -> RooflineCostModel:
        """The (calibrated, if a file is given) cost model at a block size."""
        cm = RooflineCostModel(
            self.hardware, self.model, num_gpus=self.num_gpus, block_size=block_size, **self.cost
        )
        return calibrate(cm, self.calibration) if self.calibration else cm

    def describe(self) -> str:
        """Where the run 'ran', for every output that shows its numbers."""
        return f"simulated {self.model.name} on {self.num_gpus}x {self.hardware.name}"

    def num_blocks(self, settings: ServingSettings, cm: RooflineCostModel) -> int:
        """The KV pool: the setting if given, else what fits beside weights and activations."""
        if settings.num_gpu_blocks is not None:
            return settings.num_gpu_blocks
        act = cm.activation_bytes(settings.max_num_batched_tokens, settings.max_num_seqs)
        return cm.num_kv_blocks(settings.gpu_memory_utilization, act)

    def run(
        self,
        workload: Workload,
        policy: Any,
        settings: ServingSettings,
        stop_time: float | None = None,
        progress: bool = False,
        memory_window: tuple[float | None, float | None] | None = None,
        memory_every: int = 1,
    ) -> RunTrace:
        """Replay the workload; stop when every request finished or at ``stop_time``.

        The Fig. 2 memory breakdown is taken at every ``memory_every``-th iteration that starts
        inside ``memory_window`` (all iterations by default; 0 = never); it walks every block,
        so long runs subsample it.
        """
        with _quiet_preemption_warnings():
            return self._run(
                workload, policy, settings, stop_time, progress, memory_window, memory_every
            )

    def _run(
        self,
        workload: Workload,
        policy: Any,
        settings: ServingSettings,
        stop_time: float | None,
        progress: bool,
        memory_window: tuple[float | None, float | None] | None,
        memory_every: int,
    ) -> RunTrace:
        wall0 = time.perf_counter()
        lo, hi = memory_window or (None, None)
        lo = -math.inf if lo is None else lo
        hi = math.inf if hi is None else hi
        cm = self.cost_model(settings.block_size)
        num_blocks = self.num_blocks(settings, cm)
        block_bytes = settings.block_size * self.model.kv_bytes_per_token
        num_cpu_blocks = 0
        if settings.preemption_mode == "swap":
            num_cpu_blocks = int(settings.swap_space_gib * GiB // block_bytes)
        scheduler = build_scheduler(policy, settings, num_blocks, num_cpu_blocks)
        records = {
            r.request_id: RequestRecord(r.request_id, r.input_len, r.output_len, r.arrival_time)
            for r in workload.requests
        }
        live: dict[str, Request] = {}
        pending = deque(sorted(workload.requests, key=lambda r: r.arrival_time))
        iterations: list[IterationRecord] = []
        bar = _progress(
            len(pending), progress, f"{scheduler.kv.name} @ {workload.request_rate:g} req/s"
        )
        step_time = cm.step_time
        bs = settings.block_size
        kv = scheduler.kv
        n_mem = 0
        clock = 0.0
        while pending or scheduler.has_unfinished():
            if stop_time is not None and clock >= stop_time:
                break
            while pending and pending[0].arrival_time <= clock:
                tr = pending.popleft()
                req = Request(
                    tr.request_id, [0] * tr.input_len,
                    SamplingParams(temperature=0.0, max_tokens=tr.output_len, ignore_eos=True),
                    arrival_time=tr.arrival_time, max_model_len=settings.max_model_len,
                )  # fmt: skip
                scheduler.add_request(req)
                live[tr.request_id] = req
            if not scheduler.has_unfinished():
                clock = pending[0].arrival_time  # idle: jump to the next arrival
                continue
            out = scheduler.schedule(clock)
            memory = None
            if memory_every and lo <= clock <= hi:
                if n_mem % memory_every == 0:
                    memory = kv.memory_breakdown(scheduler.running)
                n_mem += 1
            if out.is_empty:
                if not pending:
                    raise RuntimeError(
                        f"the scheduler can run none of {len(scheduler.requests)} requests "
                        f"with an empty batch ({scheduler.kv.name}, {num_blocks} blocks)"
                    )
                clock = max(clock, pending[0].arrival_time)
                continue
            dt = step_time(step_shape(out, bs))
            start, clock = clock, clock + dt
            sampled = {s.request.request_id: [0] for s in out.scheduled if s.samples}
            finished = scheduler.update_from_output(out, sampled, clock)
            st = out.stats
            iterations.append(
                IterationRecord(
                    start,
                    dt,
                    st.num_running,
                    st.num_batched_tokens,
                    st.num_waiting,
                    st.num_swapped,
                    st.kv_usage,
                    st.num_preemptions,
                    memory,
                )  # fmt: skip
            )
            for req in finished:
                _finish_record(records[req.request_id], live.pop(req.request_id))
            if bar is not None and finished:
                bar.update(len(finished))
        if bar is not None:
            bar.close()
        for rid, req in live.items():  # stopped early: keep what the unfinished ones did
            _finish_record(records[rid], req, finished=False)
        return RunTrace(
            requests=list(records.values()),
            iterations=iterations,
            end_time=clock,
            mode=self.mode,
            hardware=self.describe(),
            policy=scheduler.kv.name,
            num_kv_blocks=num_blocks,
            block_size=settings.block_size,
            wall_time_s=time.perf_counter() - wall0,
            extra={"cost_model": cm.to_dict()},
        )


@contextlib.contextmanager
def _quiet_preemption_warnings():
    """A simulated overload preempts thousands of times; the run reports the count instead of
    logging the scheduler's per-preemption warning."""
    log = logging.getLogger("paged_llm.core.scheduler")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def _finish_record(rec: RequestRecord, req: Request, finished: bool = True) -> None:
    rec.first_scheduled_time = req.first_scheduled_time
    rec.first_token_time = req.first_token_time
    rec.finished_time = req.finished_time if finished else None
    rec.token_times = req.token_times
    rec.num_preemptions = req.num_preemptions


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)
