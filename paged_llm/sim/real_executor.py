"""The real executor: the same workloads through the real LLMEngine (a model on the CPU, or
CUDA when present) against wall-clock arrivals, recorded like a simulated run."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from paged_llm.metrics.serving import IterationRecord, RequestRecord, RunTrace
from paged_llm.sim.settings import ServingSettings
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
    ) -> None:
        self.model = dict(model or {"model": "tiny"})
        self.attention = attention
        self.warmup_requests = warmup_requests
        # One intra-op thread: on a small shared CPU, more threads oversubscribe the cores and
        # make small-model steps several times slower (measured: 76 ms vs 14 ms per step).
        self.num_threads = num_threads
        # vLLM's skip_tokenizer_init: prompts are token ids and outputs are counted, not read,
        # so the engine does not detokenize every request's whole output at every step.
        self.skip_tokenizer_init = skip_tokenizer_init
        self._hardware: str | None = None

    def describe(self) -> str:
        """What the run ran on (filled in once the engine picked its device)."""
        return self._hardware or "real (device not chosen yet)"

    def engine(self, policy: Any, settings: ServingSettings) -> Any:
        """An LLMEngine with these settings and this policy."""
        from paged_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
        from paged_llm.engine.llm_engine import LLMEngine

        model = {**self.model, "max_model_len": settings.max_model_len}
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
            ),
            attention_backend=self.attention,
        )
        engine = LLMEngine(cfg)
        engine.scheduler.track_memory = True  # record the Fig. 2 breakdown every step
        if self.skip_tokenizer_init:
            engine.tokenizer = None
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
        from paged_llm.sampling_params import SamplingParams

        if any(r.n > 1 or r.beam_width > 1 or r.prefix_len for r in workload.requests):
            raise NotImplementedError(
                "parallel-sampling, beam-search and shared-prefix workloads run in the simulated "
                "executor only (executor=paper_sim or executor=simulated)"
            )
        engine = self.engine(policy, settings)
        vocab = engine.vocab_size
        self._warm_up(engine, workload, vocab)
        clock = time.monotonic
        records = {
            r.request_id: RequestRecord(r.request_id, r.input_len, r.output_len, r.arrival_time)
            for r in workload.requests
        }
        pending = deque(sorted(workload.requests, key=lambda r: r.arrival_time))
        iterations: list[IterationRecord] = []
        wall0 = time.perf_counter()
        cpu0 = time.process_time()  # this process's CPU seconds: blind to other tenants' load
        t0 = clock()
        now = 0.0
        while pending or engine.has_unfinished_requests():
            now = clock() - t0
            if stop_time is not None and now >= stop_time:
                break
            while pending and pending[0].arrival_time <= now:
                tr = pending.popleft()
                params = SamplingParams(temperature=0.0, max_tokens=tr.output_len, ignore_eos=True)
                engine.add_request(
                    tr.request_id, {"prompt_token_ids": prompt_token_ids(tr, vocab)}, params,
                    arrival_time=t0 + tr.arrival_time,
                )  # fmt: skip
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[0].arrival_time - (clock() - t0)))
                continue
            start = clock()
            outputs = engine.step()
            end = clock()
            for o in outputs:
                if o.finished:
                    _record(records[o.request_id], o.metrics, t0)
            st = engine.iteration_stats[-1]
            iterations.append(
                IterationRecord(
                    start - t0,
                    end - start,
                    st.num_running,
                    st.num_batched_tokens,
                    st.num_waiting,
                    st.num_swapped,
                    st.kv_usage,
                    st.num_preemptions,
                    st.memory,
                )  # fmt: skip
            )
        return RunTrace(
            requests=list(records.values()),
            iterations=iterations,
            end_time=clock() - t0,
            mode=self.mode,
            hardware=self.describe(),
            policy=engine.scheduler.kv.name,
            num_kv_blocks=engine.num_kv_blocks,
            block_size=settings.block_size,
            wall_time_s=time.perf_counter() - wall0,
            extra={
                "model": self.model,
                "kv_cache_tokens": engine.kv_cache_tokens,
                "cpu_time_s": time.process_time() - cpu0,
            },
        )

    def _warm_up(self, engine: Any, workload: Workload, vocab: int) -> None:
        """Run a few short requests first, so one-time costs do not land on the first request."""
        from paged_llm.sampling_params import SamplingParams

        for i, tr in enumerate(workload.requests[: self.warmup_requests]):
            warm = TimedRequest(f"warmup-{i}", tr.input_len, min(4, tr.output_len), 0.0)
            params = SamplingParams(temperature=0.0, max_tokens=warm.output_len, ignore_eos=True)
            engine.add_request(
                warm.request_id, {"prompt_token_ids": prompt_token_ids(warm, vocab)}, params
            )
        while engine.has_unfinished_requests():
            engine.step()
        engine.iteration_stats.clear()


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
