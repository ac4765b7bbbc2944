"""The real executor: the same workloads through the real LLMEngine (a model on the CPU, or
CUDA when present) against wall-clock arrivals, recorded like a simulated run."""

from __future__ import annotations

import itertools
import random
import time
import zlib
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from paged_llm.beam_search import (
    Beam,
    BeamSearchParams,
    advance_beams,
    beam_ready,
    check_beam_engine,
)
from paged_llm.engine.core import LogprobsForward
from paged_llm.metrics.serving import IterationRecord, RequestRecord, RunTrace
from paged_llm.outputs import RequestMetrics
from paged_llm.sampling_params import SamplingParams
from paged_llm.sim.clocks import make_clock
from paged_llm.sim.groups import SharingStats, check_groups_fit
from paged_llm.sim.settings import ServingSettings
from paged_llm.sim.step_recorder import recorded_shapes
from paged_llm.workloads.arrivals import TimedRequest, Workload, prompt_token_ids


class RealExecutor:
    """Runs a workload on the real engine; its KV pool is ``settings.num_gpu_blocks`` blocks
    (required on the CPU, so that small-pool experiments stay small)."""

    mode = "real"

    def __init__(
        self,
        model: dict[str, Any] | None = None,
        attention: Any = "auto",
        warmup_requests: int = 2,
        num_threads: int | None = 1,
        skip_tokenizer_init: bool = True,
        clock: str = "wall",
        record_step_shapes: bool = False,
    ) -> None:
        self.model = dict(model or {"model": "tiny"})
        self.attention = attention
        self.warmup_requests = warmup_requests
        # One intra-op thread: on a small shared CPU, more threads oversubscribe the cores and
        # make small-model steps several times slower (measured: 76 ms vs 14 ms per step).
        self.num_threads = num_threads
        # vLLM's skip_tokenizer_init: prompts are token ids and outputs are counted, not read,
        # so the engine keeps no text (as the paper's throughput runs; incremental
        # detokenization costs little now, but nothing reads the text here).
        self.skip_tokenizer_init = skip_tokenizer_init
        # what arrivals, steps and latencies are timed by: wall, process (this process's CPU
        # seconds, blind to other tenants' load) or auto (process on a CPU, wall on a GPU);
        # see paged_llm/sim/clocks.py
        self.clock = clock
        # keep each step's StepShape in trace.extra["step_shapes"] (to price the real steps
        # with a simulator's cost model: paper_repro.validate_sim)
        self.record_step_shapes = record_step_shapes
        self._hardware: str | None = None

    def describe(self) -> str:
        """What the run ran on (filled in once the engine picked its device)."""
        return self._hardware or "real (device not chosen yet)"

    def engine(self, policy: Any, settings: ServingSettings) -> Any:
        """An LLMEngine with these settings and this policy."""
        from paged_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
        from paged_llm.engine.llm_engine import LLMEngine

        model = {**self.model, "max_model_len": settings.max_model_len}
        if self.skip_tokenizer_init:
            model["skip_tokenizer_init"] = True
        cfg = EngineConfig(
            model=ModelConfig(**model),
            cache=CacheConfig(
                block_size=settings.block_size,
                num_gpu_blocks_override=settings.num_gpu_blocks,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                swap_space=settings.swap_space_gib,
                enable_prefix_caching=settings.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                policy=policy,
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                enable_chunked_prefill=settings.enable_chunked_prefill,
                preemption_mode=settings.preemption_mode,
                scheduling_policy=settings.scheduling_policy,
            ),
            attention_backend=self.attention,
        )
        engine = LLMEngine(cfg)
        engine.scheduler.track_memory = True  # record the Fig. 2 breakdown every step
        self._hardware = _hardware_label(engine)
        return engine

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
        """Replay the workload in real time; stop when all finished or at ``stop_time``."""
        import torch

        if any(r.conversation >= 0 for r in workload.requests):
            raise ValueError(
                "multi-turn conversations (workload.turns) run in the simulator only: their "
                "prompts replay earlier replies, which a real model would not have written"
            )

        threads = torch.get_num_threads()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            return self._run(workload, policy, settings, stop_time)
        finally:
            torch.set_num_threads(threads)

    def _run(
        self, workload: Workload, policy: Any, settings: ServingSettings, stop_time: float | None
    ) -> RunTrace:
        engine = self.engine(policy, settings)
        timer = make_clock(self.clock, engine.device.type)
        engine.clock = timer.now  # the engine stamps arrivals and token times with it too
        check_groups_fit(workload, engine.scheduler, settings.max_model_len)
        vocab = engine.vocab_size
        kv = engine.scheduler.kv
        # With a shared prefix or a prefix cache, prompts share exactly the prefix (as simulated)
        distinct = settings.enable_prefix_caching or any(r.prefix_len for r in workload.requests)
        driver = _driver(engine, workload.requests)  # before warm-up: refuse a workload early
        self._warm_up(engine, workload, vocab, distinct)
        shaped = any(r.n > 1 or r.beam_width > 1 or r.prefix_len for r in workload.requests)
        stats = SharingStats() if kv.supports_sharing and (shaped or distinct) else None
        prefix0 = _prefix_counts(kv)
        clock = timer.now
        records = {
            r.request_id: RequestRecord(r.request_id, r.input_len, r.output_len, r.arrival_time)
            for r in workload.requests
        }
        lens: dict[str, list[int]] = {}  # output tokens of every sequence of finished requests
        pending = deque(sorted(workload.requests, key=lambda r: r.arrival_time))
        iterations: list[IterationRecord] = []
        recording = recorded_shapes(engine) if self.record_step_shapes else nullcontext([])
        wall0 = time.perf_counter()
        cpu0 = time.process_time()  # this process's CPU seconds: blind to other tenants' load
        t0 = clock()
        now = 0.0
        with recording as shapes:
            while pending or driver.has_unfinished():
                now = clock() - t0
                if stop_time is not None and now >= stop_time:
                    break
                while pending and pending[0].arrival_time <= now:
                    tr = pending.popleft()
                    driver.add(tr, _prompt(tr, vocab, distinct), t0 + tr.arrival_time)
                if not driver.has_unfinished():
                    timer.wait(pending[0].arrival_time - (clock() - t0))
                    continue
                start = clock()
                st, finished = driver.step()
                end = clock()
                for rid, metrics, seq_lens in finished:
                    _record(records[rid], metrics, t0)
                    lens[rid] = seq_lens
                if stats is not None:
                    stats.add(_block_tables(engine), end - start)
                iterations.append(_iteration(st, start - t0, end - start))
        extra: dict[str, Any] = {
            "model": self.model,
            "kv_cache_tokens": engine.kv_cache_tokens,
            "cpu_time_s": time.process_time() - cpu0,
            "clock": timer.name,
            **({"step_shapes": shapes} if self.record_step_shapes else {}),
            "output_tokens_per_sequence": lens,
        }
        if stats is not None:
            extra["sharing"] = stats.to_dict()
        if distinct and kv.cache_stats() is not None:
            queries, hits = (a - b for a, b in zip(_prefix_counts(kv), prefix0))
            extra["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        return RunTrace(
            requests=list(records.values()),
            iterations=iterations,
            end_time=clock() - t0,
            mode=self.mode,
            hardware=self.describe(),
            policy=kv.name,
            num_kv_blocks=engine.num_kv_blocks,
            block_size=settings.block_size,
            wall_time_s=time.perf_counter() - wall0,
            extra=extra,
        )

    def _warm_up(self, engine: Any, workload: Workload, vocab: int, distinct: bool) -> None:
        """Run a few short requests first, so one-time costs do not land on the first request.
        Their prompts share no prefix with the workload's (the prefix cache starts cold)."""
        for i, tr in enumerate(workload.requests[: self.warmup_requests]):
            warm = TimedRequest(f"warmup-{i}", tr.input_len, min(4, tr.output_len), 0.0)
            engine.add_request(
                warm.request_id, {"prompt_token_ids": _prompt(warm, vocab, distinct)},
                _sampling_params(warm),
            )  # fmt: skip
        while engine.has_unfinished_requests():
            engine.step()
        engine.iteration_stats.clear()


# ---- how requests enter the engine and leave it ----------------------------------------------
_FIRST_ID = 3  # prompt ids start here, as prompt_token_ids's pattern does (0-2 may be special)
# A finished request: its id, its metrics (engine-clock times) and each sequence's output length.
Finished = tuple[str, Any, list[int]]


class _Sampled:
    """Requests of one sequence or of n parallel samples, through ``LLMEngine.add_request`` and
    ``step``: the engine forks the samples off the first one's prefill (sharing policies) or
    queues them as independent sequences of one group (reservation policies), and reports a
    request finished when its last sample is."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def add(self, tr: TimedRequest, prompt: list[int], arrival: float) -> None:
        """Queue one request of the workload."""
        self.engine.add_request(
            tr.request_id, {"prompt_token_ids": prompt}, _sampling_params(tr),
            arrival_time=arrival, priority=tr.priority,
        )  # fmt: skip

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        return self.engine.has_unfinished_requests()

    def step(self) -> tuple[Any, list[Finished]]:
        """One engine step: its scheduler statistics and the requests it finished."""
        done = [o for o in self.engine.step() if o.finished]
        lens = [[len(c.token_ids) for c in o.outputs] for o in done]
        return self.engine.iteration_stats[-1], [
            (o.request_id, o.metrics, n) for o, n in zip(done, lens)
        ]


@dataclass
class _BeamGroup:
    """One beam-search request: its live beams and what the finished ones produced."""

    params: BeamSearchParams
    beams: list[Beam]
    num_prompt_tokens: int
    arrival_time: float
    done: list[Any] = field(default_factory=list)  # BeamSearchSequence, one per final beam
    token_times: list[float] = field(default_factory=list)  # one per beam-search step
    first_scheduled_time: float | None = None
    preemptions: int = 0  # summed over beam generations (each preempted as a group)

    def metrics(self, now: float) -> RequestMetrics:
        """As a simulated beam group records it: a token per step, done at the last step."""
        return RequestMetrics(
            self.arrival_time, self.first_scheduled_time, self.token_times[0], now,
            list(self.token_times), self.preemptions,
        )  # fmt: skip


class _BeamSearches:
    """Beam-search requests arriving over time, each stepped as ``paged_llm.beam_search`` steps
    a batch (its ``beam_ready`` / ``advance_beams``): once all of a request's live beams have their
    next-token log-probabilities, the best ``beam_width`` extensions fork their parents' block
    tables (copy-on-write) and the parents are aborted. The request finishes at its last step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.groups: dict[str, _BeamGroup] = {}
        self.rows: dict[str, Any] = {}  # sequence id -> its next-token log-probabilities
        self.forward = LogprobsForward(engine.runner, self.rows)  # the beams pick the tokens
        self.ids = itertools.count()

    def add(self, tr: TimedRequest, prompt: list[int], arrival: float) -> None:
        """Queue the request's first sequence (it prefills; the beams fork off it)."""
        params = SamplingParams(temperature=0.0, max_tokens=tr.output_len, ignore_eos=True)
        group = self.engine.inputs.make_request(
            tr.request_id, {"prompt_token_ids": prompt}, params, arrival, tr.priority
        )
        req = group.members[0].request
        req.group_id = tr.request_id  # a request's beams are admitted and preempted together
        self.engine.scheduler.add_request(req)
        beam = BeamSearchParams(tr.beam_width, tr.output_len, ignore_eos=True)
        self.groups[tr.request_id] = _BeamGroup(beam, [Beam(req, [], 0.0)], len(prompt), arrival)

    def has_unfinished(self) -> bool:
        """True while any beam search is unfinished."""
        return bool(self.groups)

    def step(self) -> tuple[Any, list[Finished]]:
        """One step of the model for every scheduled beam, then a beam-search step for every
        request whose beams are all ready."""
        step = self.engine.core.step(self.forward)
        out, now = step.out, step.now
        finished = [rid for rid, g in self.groups.items() if self._step_group(rid, g, now)]
        return out.stats, [self._finish(rid, now) for rid in finished]

    def _step_group(self, rid: str, g: _BeamGroup, now: float) -> bool:
        """A beam-search step for one request if its beams are ready; True when it is done."""
        if not all(beam_ready(b, self.rows) for b in g.beams):
            return False
        if g.first_scheduled_time is None:
            g.first_scheduled_time = g.beams[0].request.first_scheduled_time
        g.token_times.append(now)
        g.preemptions += max(b.request.num_preemptions for b in g.beams)
        width = g.params.beam_width
        g.beams = advance_beams(
            self.engine, g.beams, self.rows, g.done, g.params, width, self.ids, rid
        )
        return not g.beams

    def _finish(self, rid: str, now: float) -> Finished:
        g = self.groups.pop(rid)
        return rid, g.metrics(now), [len(s.tokens) - g.num_prompt_tokens for s in g.done]


def _driver(engine: Any, requests: list[TimedRequest]) -> _Sampled | _BeamSearches:
    """Beam searches run as beam search with a sharing policy; every other request (and, as in
    simulated runs, a beam search under a policy that cannot share: ``beam_width`` independent
    sequences) runs through the engine's own request loop. One run holds one kind."""
    sharing = engine.scheduler.kv.supports_sharing
    beams = {r.beam_width > 1 and sharing for r in requests}
    if len(beams) > 1:
        raise NotImplementedError(
            "the real executor runs beam-search requests and sampled requests in separate "
            "runs, not mixed in one workload"
        )
    if True in beams:
        check_beam_engine(engine)
        return _BeamSearches(engine)
    return _Sampled(engine)


def _sampling_params(tr: TimedRequest) -> SamplingParams:
    """Greedy for one sequence; n > 1 (or a beam search that cannot share) samples at
    temperature 1 with a seed fixed per request, so reruns draw the same tokens."""
    width = max(tr.n, tr.beam_width)
    if width == 1:
        return SamplingParams(temperature=0.0, max_tokens=tr.output_len, ignore_eos=True)
    seed = zlib.crc32(tr.request_id.encode())
    return SamplingParams(
        n=width, temperature=1.0, seed=seed, max_tokens=tr.output_len, ignore_eos=True
    )


def _prompt(tr: TimedRequest, vocab: int, distinct: bool) -> list[int]:
    """Prompt ids: the fixed pattern of ``prompt_token_ids`` (the same for every request), or,
    when ``distinct``, that pattern for the shared prefix only and ids drawn per request (seeded
    by its id) after it, so a prefix cache finds exactly the shared prefix, as in simulated
    runs (``paged_llm.sim.groups.prompt_ids``)."""
    ids = prompt_token_ids(tr, vocab)
    if not distinct:
        return ids
    rng = random.Random(tr.request_id)
    own = [rng.randrange(_FIRST_ID, vocab) for _ in range(tr.input_len - tr.prefix_len)]
    return ids[: tr.prefix_len] + own


def _block_tables(engine: Any) -> list[list[int]]:
    """The running sequences' block tables (a shared block appears in each that holds it)."""
    tables = engine.scheduler.kv.block_tables
    return [tables.get(r.request_id, []) for r in engine.scheduler.running]


def _prefix_counts(kv: Any) -> tuple[int, int]:
    """Prefix-cache blocks looked up and found so far (0, 0 without a prefix cache)."""
    stats = kv.cache_stats()
    return (0, 0) if stats is None else (stats.prefix_queries, stats.prefix_hits)


def _iteration(st: Any, start: float, duration: float) -> IterationRecord:
    """An engine step's scheduler statistics as a trace record."""
    return IterationRecord(
        start, duration, st.num_running, st.num_batched_tokens, st.num_waiting, st.num_swapped,
        st.kv_usage, st.num_preemptions, st.memory,
    )  # fmt: skip


def _record(rec: RequestRecord, m: Any, t0: float) -> None:
    rel = lambda t: None if t is None else t - t0
    rec.first_scheduled_time = rel(m.first_scheduled_time)
    rec.first_token_time = rel(m.first_token_time)
    rec.finished_time = rel(m.finished_time)
    rec.token_times = [t - t0 for t in m.token_times]
    rec.num_preemptions = m.num_preemptions


def _hardware_label(engine: Any) -> str:
    from paged_llm.metrics.run_info import hardware_info

    info = hardware_info(str(engine.device))
    where = info.get("gpu") or f"CPU {info['cpu']} ({info['cpu_count']} cores)"
    return f"real {engine.config.model.model} on {where}, torch {info['torch']}"
