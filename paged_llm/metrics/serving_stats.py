"""What the server's ``/metrics`` and ``LLM.get_metrics`` report, as plain data with vLLM's
metric names: request counters and latency histograms fed with finished outputs
(``RequestStats``), the engine's state snapshotted after a step (``EngineGauges``), and one table
of metric families built from both (``metric_families``). The server renders that table through
prometheus_client (serve/metrics.py); ``LLM.get_metrics`` turns it into vLLM's reader types
(metrics/reader.py). Plain Python: no torch, no prometheus_client.

Counters and histograms are fed by the engine thread and read by ``/metrics`` on the event
loop, so every access holds one lock. Engine-owned state is a snapshot the engine thread takes
after each step, so the event loop never reads objects the engine is mutating. Prefix-cache and
speculative counters are exported only when the feature is on: zeros would be misleading.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.kv.base import KVCacheStats

# vLLM's bucket boundaries (seconds), so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")
# The one counter vLLM reads as a vector: accepted drafts by position in the draft.
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeCounts:
    """A copy of the engine's SpecDecodeStats counters."""

    num_drafts: int  # (sequence, step) verifications that had drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]


@dataclass(frozen=True)
class LoRAGauges:
    """vLLM's ``vllm:lora_requests_info`` labels: the adapter limit and the adapters of the
    running and the waiting requests, by name."""

    max_lora: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]


@dataclass(frozen=True)
class EngineGauges:
    """Scheduler state after the engine thread's latest step."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0
    prefix_cache: KVCacheStats | None = None  # None: prefix caching is off
    spec_decode: SpecDecodeCounts | None = None  # None: no speculative decoding
    lora: LoRAGauges | None = None  # None: LoRA is off
    sleep_level: int = 0  # sleep mode: 0 awake, else the level the engine sleeps at
    # kv_transfer_config: rank 0's connector stats (blocks, bytes, seconds each way); None: off
    kv_transfer: dict[str, float] | None = None
    time: float = 0.0  # when the snapshot was taken (time.time())


def engine_gauges(engine: Any) -> EngineGauges:
    """Snapshot an LLMEngine's scheduler state and counters (call on the engine thread)."""
    sched = engine.scheduler
    cache = sched.kv.cache_stats()
    connector = engine.kv_connector
    return EngineGauges(
        running=len(sched.running),
        waiting=len(sched.waiting),
        swapped=len(sched.swapped),
        kv_usage=engine.kv_usage(),
        preemptions=sched.num_preemptions_total,
        prefix_cache=cache if cache is not None and cache.prefix_caching else None,
        spec_decode=_spec_decode_counts(engine),
        lora=_lora_gauges(engine),
        sleep_level=engine.sleep_state.level,
        kv_transfer=None if connector is None else connector.stats(),
        time=time.time(),
    )


def _lora_gauges(engine: Any) -> LoRAGauges | None:
    """Which adapters the running and waiting requests use, if LoRA is on."""
    if engine.lora is None:
        return None
    names = {i: r.lora_name for i, r in engine.lora.registered.items()}

    def adapters(requests: Iterable[Any]) -> tuple[str, ...]:
        return tuple(sorted({names.get(r.lora_int_id, str(r.lora_int_id))
                             for r in requests if r.lora_int_id}))  # fmt: skip

    sched = engine.scheduler
    max_loras = engine.config.lora.max_loras
    return LoRAGauges(max_loras, adapters(sched.running), adapters(sched.waiting))


def _spec_decode_counts(engine: Any) -> SpecDecodeCounts | None:
    """The engine's speculative-decoding counters, if it has a drafter."""
    if engine.drafter is None:
        return None
    st = engine.spec_stats
    # every position up to k from the start, so per-position series exist before any draft
    k = engine.drafter.k
    per_pos = list(st.accepted_per_position) + [0] * (k - len(st.accepted_per_position))
    return SpecDecodeCounts(
        st.num_spec_steps, st.num_draft_tokens, st.num_accepted_tokens, tuple(per_pos)
    )


class Histogram:
    """Observations counted into fixed buckets (upper bounds), as Prometheus exposes them."""

    def __init__(self, buckets: Iterable[float]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)  # per bucket, not yet cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.count += 1
        self.sum += value
        i = bisect.bisect_left(self.buckets, value)  # first bucket with le >= value
        if i < len(self.buckets):
            self.counts[i] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le label, cumulative count) pairs ending with +Inf."""
        out, total = [], 0
        for le, n in zip(self.buckets, self.counts):
            total += n
            out.append((repr(float(le)), total))
        out.append(("+Inf", self.count))
        return out


@dataclass(frozen=True)
class HistogramValue:
    """One histogram's state: cumulative (le, count) pairs ending with +Inf, and the sum."""

    buckets: tuple[tuple[str, int], ...]
    sum: float

    @property
    def count(self) -> int:
        """Observations in all (the +Inf bucket)."""
        return self.buckets[-1][1]


@dataclass(frozen=True)
class Family:
    """One metric family: its name (a counter's without ``_total``), kind (gauge, counter or
    histogram), help text, and samples as (labels, value) pairs."""

    name: str
    kind: str
    help: str
    samples: list[tuple[dict[str, str], Any]] = field(default_factory=list)


class RequestStats:
    """Token counters, finished-request counters and latency histograms of one server (or of
    one offline ``LLM``, for ``LLM.get_metrics``), fed with finished outputs."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)

    def record_tokens(self, prompt: int, generation: int) -> None:
        """Count prompt tokens (once, at the first output) and newly generated tokens."""
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generation

    def record_finish_reason(self, reason: str | None) -> None:
        """Count one sequence (choice) that the engine finished (stop or length)."""
        with self._lock:
            reason = reason or "stop"
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def record_latencies(self, m: Any) -> None:
        """Observe the latencies of one finished request (its ``RequestMetrics``; None: none)."""
        if m is None:
            return
        with self._lock:
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            for a, b in zip(m.token_times, m.token_times[1:]):
                self.tpot.observe(b - a)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)

    def record_aborted(self, count: int = 1) -> None:
        """Count requests aborted by a client disconnect or a shutdown."""
        with self._lock:
            self.finished["abort"] += count

    def families(self, gauges: EngineGauges) -> list[Family]:
        """Every metric family, from these counters and the engine's latest snapshot."""
        model = {"model_name": self.model_name}
        with self._lock:
            out = [Family(name, kind, help_, [(model, value)])
                   for name, kind, help_, value in self._scalars(gauges)]  # fmt: skip
            out.append(Family("vllm:request_success", "counter",
                              "Count of finished requests, by finish reason.",
                              [({"finished_reason": r, **model}, n)
                               for r, n in self.finished.items()]))  # fmt: skip
            for name, help_, h in self._histograms():
                value = HistogramValue(tuple(h.cumulative()), h.sum)
                out.append(Family(name, "histogram", help_, [(model, value)]))
        out += [Family(name, "counter", help_, [(model, value)])
                for name, help_, value in _engine_counters(gauges)]  # fmt: skip
        if gauges.lora is not None:  # as vLLM: the labels carry the state, the value a time
            lg = gauges.lora
            labels = {"max_lora": str(lg.max_lora), "running_lora_adapters": ",".join(lg.running),
                      "waiting_lora_adapters": ",".join(lg.waiting)}  # fmt: skip
            help_ = "Running stats on LoRA requests."
            out.append(Family("vllm:lora_requests_info", "gauge", help_, [(labels, gauges.time)]))
        states = ("awake", "weights_offloaded", "discard_all")  # as vLLM: 1 for the current one
        out.append(Family("vllm:engine_sleep_state", "gauge",
                          "Engine sleep state: awake, weights_offloaded (level 1) or "
                          "discard_all (level 2).",
                          [({**model, "sleep_state": s}, int(gauges.sleep_level == level))
                           for level, s in enumerate(states)]))  # fmt: skip
        if gauges.spec_decode is not None:
            per_pos = gauges.spec_decode.accepted_per_position
            out.append(Family(PER_POSITION, "counter",
                              "Accepted draft tokens, by position in the draft.",
                              [({**model, "position": str(p)}, n)
                               for p, n in enumerate(per_pos)]))  # fmt: skip
        return out

    def _scalars(self, g: EngineGauges) -> list[tuple[str, str, str, float]]:
        return [
            ("vllm:num_requests_running", "gauge", "Number of requests in the running batch.",
             g.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be scheduled.",
             g.waiting),
            ("vllm:num_requests_swapped", "gauge", "Number of requests swapped out to CPU.",
             g.swapped),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             g.kv_usage),
            ("vllm:gpu_cache_usage_perc", "gauge",
             "KV-cache usage (vLLM's older name of vllm:kv_cache_usage_perc).", g.kv_usage),
            ("vllm:num_preemptions", "counter", "Cumulative number of preemptions.",
             g.preemptions),
            ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
             self.prompt_tokens),
            ("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
             self.generation_tokens),
        ]  # fmt: skip

    def _histograms(self) -> list[tuple[str, str, Histogram]]:
        return [
            ("vllm:time_to_first_token_seconds", "Time to first token in seconds.", self.ttft),
            ("vllm:time_per_output_token_seconds",
             "Time per output token (gap between consecutive tokens) in seconds.", self.tpot),
            ("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
             self.e2e),
            ("vllm:request_queue_time_seconds", "Time waiting before first being scheduled.",
             self.queue),
        ]  # fmt: skip


def _engine_counters(g: EngineGauges) -> list[tuple[str, str, float]]:
    """(name, help, value) of the prefix-cache, KV-transfer and speculative counters that are
    on; names without ``_total``."""
    out = []
    if g.prefix_cache is not None:
        out += [
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in KV blocks (vLLM counts tokens): full prompt blocks "
             "looked up.", g.prefix_cache.prefix_queries),
            ("vllm:prefix_cache_hits",
             "Prefix cache hits, in KV blocks (vLLM counts tokens): looked-up blocks found.",
             g.prefix_cache.prefix_hits),
        ]  # fmt: skip
    if g.prefix_cache is not None and g.prefix_cache.offload is not None:
        saved, loaded = g.prefix_cache.offload
        out += [
            ("paged_llm:kv_offload_saved_blocks",
             "Cached KV blocks copied from the device to the CPU tier (--kv-offloading-size) "
             "before their device block was reused.", saved),
            ("paged_llm:kv_offload_loaded_blocks",
             "KV blocks found in the CPU tier and copied back to the device.", loaded),
        ]  # fmt: skip
    if g.kv_transfer is not None:
        t = g.kv_transfer
        out += [
            ("paged_llm:kv_transfer_saved_blocks",
             "KV blocks this engine saved through its KV connector (kv_producer, kv_both).",
             t["blocks_saved"]),
            ("paged_llm:kv_transfer_loaded_blocks",
             "KV blocks this engine loaded through its KV connector instead of computing them.",
             t["blocks_loaded"]),
            ("paged_llm:kv_transfer_saved_bytes", "Bytes the KV connector wrote.",
             t["bytes_saved"]),
            ("paged_llm:kv_transfer_loaded_bytes", "Bytes the KV connector read.",
             t["bytes_loaded"]),
            ("paged_llm:kv_transfer_save_seconds",
             "Seconds spent saving KV blocks (inside engine steps).", t["seconds_saving"]),
            ("paged_llm:kv_transfer_load_seconds",
             "Seconds spent loading KV blocks (inside engine steps).", t["seconds_loading"]),
            ("paged_llm:kv_transfer_save_failures",
             "KV blocks that could not be saved (skipped; the step went on).",
             t["save_failures"]),
        ]  # fmt: skip
    if g.spec_decode is not None:
        s = g.spec_decode
        out += [
            ("vllm:spec_decode_num_drafts",
             "Number of spec decoding drafts (sequence-steps that verified draft tokens).",
             s.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
             s.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             s.num_accepted_tokens),
        ]  # fmt: skip
    return out
