"""The simulated executor: the real Scheduler and KV manager, a virtual clock, and each
iteration's duration from the cost model instead of a GPU (plain Python, no torch)."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_llm.core.scheduler import SchedulerOutput
from paged_llm.engine.core import EngineCore, EnginePlugin, StepState
from paged_llm.metrics.serving import IterationRecord, RequestRecord, RunTrace
from paged_llm.sim.calibration import calibrate
from paged_llm.sim.cost_model import RooflineCostModel, StepShape
from paged_llm.sim.fast_forward import DecodeFastForward
from paged_llm.sim.groups import SequenceGroup, SharingStats, check_groups_fit, prompt_ids
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


def shape_of_checkpoint(model: str, name: str | None = None, dtype_bytes: int = 2) -> ModelShape:
    """The cost model's shape of ``model=`` (a checkpoint directory, "tiny" or a preset), read
    from its HF config: the simulator's twin of a real run's model."""
    from paged_llm.distributed.checks import model_hf_config  # imports torch: only here
    from paged_llm.sim.model_shapes import from_hf_config

    return from_hf_config(model_hf_config(model), name or str(model), dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class RunCheck:
    """Looks at a run as it goes: at each of ``times`` (simulated seconds) the trace so far,
    the one ``run(stop_time=t)`` would return, goes to ``stop``; the run ends there when it
    says True (e.g. an SLO already lost for good). ``stop`` must not keep the trace."""

    times: Sequence[float]
    stop: Callable[[RunTrace], bool]


HOST_DEVICE_MOVES = frozenset({"swap_in", "swap_out", "offload", "onload"})


def step_shape(
    out: SchedulerOutput, block_size: int, sliding_window: int | None = None
) -> StepShape:
    """Sum what the scheduled requests compute and read this step; with a sliding window W,
    the token at position p reads positions p - W + 1 .. p only."""
    new = kv = blocks = pairs = 0
    for s in out.scheduled:
        n = s.num_new_tokens
        before = s.request.num_computed_tokens
        ctx = before + n
        new += n
        first = 0 if sliding_window is None else max(0, before + 1 - sliding_window)
        kv += ctx - first  # the keys some query of this step reads
        blocks += -(-ctx // block_size) - first // block_size
        pairs += _causal_pairs(before, ctx, sliding_window)
    # blocks crossing between host and device: swaps and the prefix cache's offload tier
    moved = sum(len(p) for kind, p in out.block_ops if kind in HOST_DEVICE_MOVES)
    return StepShape(len(out.scheduled), new, kv, blocks, pairs, moved)


def _causal_pairs(before: int, ctx: int, window: int | None) -> int:
    """(query, key) pairs of queries at positions before .. ctx - 1: min(p + 1, W) each."""
    if window is None:
        return (ctx - before) * before + (ctx - before) * (ctx - before + 1) // 2
    lo, hi = before + 1, ctx  # keys each query reads, unwindowed: p + 1 for p in [before, ctx)
    growing = max(0, min(hi, window) - lo + 1)  # queries that still read all their keys
    first = lo if growing else 0
    full = (hi - lo + 1) - growing
    return growing * (first + first + growing - 1) // 2 + full * window


class SimulatedForward:
    """The model's step in the simulator (engine/core.py's forward): forks the waiting samples
    of a request whose prompt ran, prices the step with the cost model and advances the virtual
    clock; every sampling sequence gets a placeholder token (beams choose theirs after the step,
    from ``beam_groups``)."""

    def __init__(
        self, scheduler: Any, owner: dict[str, SequenceGroup], step_time: Any, block_size: int,
        window: int | None, sharing: SharingStats | None, sharing_window: tuple[float, float],
    ) -> None:  # fmt: skip
        self.scheduler, self.owner, self.step_time = scheduler, owner, step_time
        self.block_size, self.window = block_size, window
        self.sharing = sharing  # block sharing, measured while the clock is in sharing_window
        self.sharing_window = sharing_window
        self.clock = 0.0  # the virtual time: the core's clock reads it
        self.start = self.dt = 0.0  # the last step's start and duration
        self.beam_groups: dict[int, SequenceGroup] = {}  # beam searches the last step advanced

    def measures_sharing(self, clock: float) -> bool:
        """True when a step starting at ``clock`` adds to the sharing statistics."""
        lo, hi = self.sharing_window
        return self.sharing is not None and lo <= clock <= hi

    def __call__(self, step: StepState) -> None:
        """Run one step on the virtual clock (an empty one takes no time)."""
        out, owner = step.out, self.owner
        self.beam_groups = {}
        if out.is_empty:
            return
        for s in out.scheduled:
            g = owner[s.request.request_id]
            if g.unforked and s.samples and s.request is g.live[0]:
                owner.update((c.request_id, g) for c in g.fork_samples(self.scheduler))
            if g.is_beam:
                self.beam_groups[id(g)] = g
        self.dt = self.step_time(step_shape(out, self.block_size, self.window))
        if self.measures_sharing(self.clock):
            kv, running = self.scheduler.kv, self.scheduler.running
            self.sharing.add([kv.block_tables.get(r.request_id, []) for r in running], self.dt)
        self.start, self.clock = self.clock, self.clock + self.dt
        # beams take no sampled token: the beam-search step picks their next tokens
        step.sampled = {
            s.request.request_id: [0]
            for s in out.scheduled
            if s.samples and not owner[s.request.request_id].is_beam
        }


class MemorySampler(EnginePlugin):
    """Takes the Fig. 2 memory breakdown at every ``every``-th step that starts inside the
    window (0: never), after scheduling; ``last`` is this step's (None when not taken)."""

    def __init__(self, scheduler: Any, clock: Any, window: tuple[float, float], every: int) -> None:
        self.scheduler, self.clock, self.window, self.every = scheduler, clock, window, every
        self.count = 0
        self.last: Any = None

    def active(self, clock: float) -> bool:
        """True when a step starting at ``clock`` counts towards the sampling."""
        lo, hi = self.window
        return bool(self.every) and lo <= clock <= hi

    def before_forward(self, step: StepState) -> None:
        """Walk the KV manager's blocks if this step is sampled."""
        self.last = None
        if not self.active(self.clock()):
            return
        if self.count % self.every == 0:
            self.last = self.scheduler.kv.memory_breakdown(self.scheduler.running)
        self.count += 1


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
        fast_forward: bool = True,
    ) -> None:
        """``hardware`` / ``model``: a preset name, an object, or a mapping ``{name: preset,
        **field overrides}`` as the ``hardware`` and ``model_shape`` config groups give it (the
        hardware mapping may carry ``num_gpus``; the model mapping may give ``checkpoint:
        <model=>`` instead, the shape of a real checkpoint or preset). ``fast_forward``:
        advance pure-decode windows without the scheduler, with identical results
        (sim/fast_forward.py); False steps every iteration through it."""
        hw = dict(hardware) if isinstance(hardware, Mapping) else {"name": hardware}
        gpus = hw.pop("num_gpus", 1)
        self.num_gpus = int(num_gpus if num_gpus is not None else gpus)
        name = hw.pop("name")
        self.hardware = name if isinstance(name, GPUSpec) else get_hardware(name, **hw)
        m = dict(model) if isinstance(model, Mapping) else {"name": model}
        if "checkpoint" in m:  # the shape of a real model: a checkpoint directory or preset
            self.model = shape_of_checkpoint(m.pop("checkpoint"), **m)
        else:
            name = m.pop("name")
            self.model = name if isinstance(name, ModelShape) else get_model_shape(name, **m)
        self.cost = dict(cost or {})
        self.calibration = resolve_config_path(calibration) if calibration else None
        self.fast_forward = fast_forward

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
        check: RunCheck | None = None,
    ) -> RunTrace:
        """Replay the workload; stop when every request finished, at ``stop_time``, or at a
        time of ``check`` whose look at the run says so.

        The Fig. 2 memory breakdown is taken at every ``memory_every``-th iteration that starts
        inside ``memory_window`` (all iterations by default; 0 = never); it walks every block,
        so long runs subsample it.
        """
        with quiet_preemption_warnings():
            return self._run(
                workload, policy, settings, stop_time, progress, memory_window, memory_every,
                check,
            )  # fmt: skip

    def _run(
        self,
        workload: Workload,
        policy: Any,
        settings: ServingSettings,
        stop_time: float | None,
        progress: bool,
        memory_window: tuple[float | None, float | None] | None,
        memory_every: int,
        check: RunCheck | None,
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
        window = self.model.sliding_window
        num_offload = int(settings.kv_offloading_size * GiB // block_bytes)
        scheduler = build_scheduler(
            policy, settings, num_blocks, num_cpu_blocks, sliding_window=window,
            num_offload_blocks=num_offload,
        )  # fmt: skip
        records = {
            r.request_id: RequestRecord(r.request_id, r.input_len, r.output_len, r.arrival_time)
            for r in workload.requests
        }
        kv = scheduler.kv
        sharing = kv.supports_sharing
        distinct = settings.enable_prefix_caching  # prompts whose shared prefix is the only match
        shaped = any(r.n > 1 or r.beam_width > 1 or r.prefix_len for r in workload.requests)
        stats = SharingStats() if sharing and (shaped or distinct) else None
        rng = random.Random(workload.meta.get("seed", 0))  # beam parents
        parents = workload.meta.get("beam_parents", "uniform")
        check_groups_fit(workload, scheduler, settings.max_model_len)
        groups: dict[str, SequenceGroup] = {}  # request id -> its unfinished sequence group
        owner: dict[str, SequenceGroup] = {}  # sequence id -> its group
        pending = deque(sorted(workload.requests, key=lambda r: r.arrival_time))
        iterations: list[IterationRecord] = []
        bar = _progress(len(pending), progress, f"{kv.name} @ {workload.request_rate:g} req/s")
        sim = SimulatedForward(
            scheduler, owner, cm.step_time, settings.block_size, window, stats, (lo, hi)
        )
        memory = MemorySampler(scheduler, lambda: sim.clock, (lo, hi), memory_every)
        core = EngineCore(scheduler, sim, [memory], lambda: sim.clock)  # the engine's step

        def retire(finished: list[Any], clock: float) -> None:
            """Close the sequences a step finished, and the requests whose last one it was."""
            done = []
            for req in finished:
                g = owner.pop(req.request_id)
                g.on_finished(req, clock)
                if g.finished:
                    done.append(g)
            close(done)

        def close(done: list[SequenceGroup]) -> None:
            for g in done:
                g.fill_record(records[g.tr.request_id])
                del groups[g.tr.request_id]
            if bar is not None and done:
                bar.update(len(done))

        looks = deque(sorted(check.times) if check is not None else ())

        def must_step(clock: float) -> bool:
            """A step starting at ``clock`` is the ordinary loop's (see fast_forward.py)."""
            return (
                (stop_time is not None and clock >= stop_time)
                or (bool(looks) and clock >= looks[0])
                or (bool(pending) and pending[0].arrival_time <= clock)
                or memory.active(clock)
                or sim.measures_sharing(clock)
            )

        def trace() -> RunTrace:
            """The run so far (unfinished requests keep what they did)."""
            for rid, g in groups.items():  # stopped early: keep what the unfinished ones did
                g.fill_record(records[rid])
            extra: dict[str, Any] = {"cost_model": cm.to_dict(), "fast_forward": ff.to_dict()}
            if stats is not None:
                extra["sharing"] = stats.to_dict()
            cache = kv.cache_stats()
            if distinct and cache is not None:
                extra["prefix_cache_hit_rate"] = cache.prefix_hit_rate
            if cache is not None and cache.offload is not None:
                saved, loaded = cache.offload
                extra["kv_offload"] = {"blocks": cache.offload_blocks, "saved": saved,
                                       "loaded": loaded}  # fmt: skip
            return RunTrace(
                requests=list(records.values()),
                iterations=iterations,
                end_time=sim.clock,
                mode=self.mode,
                hardware=self.describe(),
                policy=kv.name,
                num_kv_blocks=num_blocks,
                block_size=settings.block_size,
                wall_time_s=time.perf_counter() - wall0,
                extra=extra,
            )

        ff = DecodeFastForward(scheduler, sim, owner, settings.block_size, iterations, retire)
        fast = self.fast_forward and window is None
        n_arrived = 0
        while pending or scheduler.has_unfinished():
            if fast and ff.advance(must_step):
                continue
            if stop_time is not None and sim.clock >= stop_time:
                break
            if looks and sim.clock >= looks[0]:  # the state run(stop_time=looks[0]) ends in
                while looks and sim.clock >= looks[0]:
                    looks.popleft()
                if check.stop(trace()):
                    break
            while pending and pending[0].arrival_time <= sim.clock:
                tr = pending.popleft()
                prompt = prompt_ids(tr, n_arrived, distinct)
                g = SequenceGroup(tr, prompt, settings.max_model_len, sharing, rng, parents)
                g.start(scheduler)
                groups[tr.request_id] = g
                owner.update((r.request_id, g) for r in g.live + g.unforked)
                n_arrived += 1
            if not scheduler.has_unfinished():
                sim.clock = pending[0].arrival_time  # idle: jump to the next arrival
                continue
            step = core.step()
            if step.out.is_empty:
                if not pending:
                    raise RuntimeError(
                        f"the scheduler can run none of {len(scheduler.requests)} requests "
                        f"with an empty batch ({kv.name}, {num_blocks} blocks)"
                    )
                sim.clock = max(sim.clock, pending[0].arrival_time)
                continue
            clock = sim.clock
            st = step.out.stats
            iterations.append(
                IterationRecord(
                    sim.start,
                    sim.dt,
                    st.num_running,
                    st.num_batched_tokens,
                    st.num_waiting,
                    st.num_swapped,
                    st.kv_usage,
                    st.num_preemptions,
                    memory.last,
                )  # fmt: skip
            )
            retire(step.finished, clock)
            done = []
            for g in sim.beam_groups.values():
                if g.beams_ready():
                    for b in g.live:
                        owner.pop(b.request_id)
                    owner.update((c.request_id, g) for c in g.advance_beams(scheduler, clock))
                    if g.finished:
                        done.append(g)
            close(done)
        if bar is not None:
            bar.close()
        return trace()


@contextlib.contextmanager
def quiet_preemption_warnings():
    """A simulated overload preempts thousands of times; the run reports the count instead of
    logging the scheduler's per-preemption warning."""
    log = logging.getLogger("paged_llm.core.scheduler")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)
