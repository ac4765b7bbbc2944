"""Server metrics in Prometheus' text format (0.0.4), written by hand, with vLLM's metric names.

Counters and histograms are fed by the engine thread and read by ``/metrics`` on the event
loop, so every access holds one lock. Engine-owned state (gauges, and the prefix-cache and
speculative-decoding counters the engine keeps itself) is a snapshot the engine thread takes
after each step, so the event loop never reads objects the engine is mutating. Prefix-cache and
speculative counters are exported only when the feature is on: zeros would be misleading.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from paged_llm.metrics.reader import PER_POSITION
from paged_llm.outputs import RequestMetrics

# vLLM's bucket boundaries (seconds), so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class EngineGauges:
    """Scheduler state after the engine thread's latest step."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0
    prefix_cache: PrefixCacheCounts | None = None  # None: prefix caching is off
    spec_decode: SpecDecodeCounts | None = None  # None: no speculative decoding
    lora: LoRAGauges | None = None  # None: LoRA is off
    sleep_level: int = 0  # sleep mode: 0 awake, else the level the engine sleeps at
    # kv_transfer_config: rank 0's connector stats (blocks, bytes, seconds each way); None: off
    kv_transfer: dict[str, float] | None = None
    time: float = 0.0  # when the snapshot was taken (time.time())


@dataclass(frozen=True)
class PrefixCacheCounts:
    """The KV manager's prefix-cache lookups, in blocks (not vLLM's tokens)."""

    queries: int
    hits: int  # on the device or in the CPU tier
    offload: tuple[int, int] | None = None  # CPU tier: (blocks copied out, copied back); None: off


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


def engine_gauges(engine: Any) -> EngineGauges:
    """Snapshot the engine's scheduler state and counters (call on the engine thread)."""
    sched = engine.scheduler
    return EngineGauges(
        running=len(sched.running),
        waiting=len(sched.waiting),
        swapped=len(sched.swapped),
        kv_usage=engine.kv_usage(),
        preemptions=sched.num_preemptions_total,
        prefix_cache=_prefix_cache_counts(getattr(sched, "kv", None)),
        spec_decode=_spec_decode_counts(engine),
        lora=_lora_gauges(engine),
        sleep_level=engine.sleep_state.level,
        kv_transfer=_kv_transfer_stats(engine),
        time=time.time(),
    )


def _kv_transfer_stats(engine: Any) -> dict[str, float] | None:
    """The KV connector's counters, if the engine has one."""
    connector = getattr(engine, "kv_connector", None)
    return None if connector is None else connector.stats()


def _lora_gauges(engine: Any) -> LoRAGauges | None:
    """Which adapters the running and waiting requests use, if LoRA is on."""
    lora = getattr(engine, "lora", None)
    if lora is None:
        return None
    names = {i: r.lora_name for i, r in lora.registered.items()}

    def adapters(requests: Iterable[Any]) -> tuple[str, ...]:
        return tuple(sorted({names.get(r.lora_int_id, str(r.lora_int_id))
                             for r in requests if r.lora_int_id}))  # fmt: skip

    sched = engine.scheduler
    max_loras = engine.config.lora.max_loras
    return LoRAGauges(max_loras, adapters(sched.running), adapters(sched.waiting))


def _prefix_cache_counts(kv: Any) -> PrefixCacheCounts | None:
    """The KV manager's prefix-cache counters, if it caches prefixes."""
    if not getattr(kv, "enable_prefix_caching", False):
        return None
    tier = getattr(kv, "offload", None)
    offload = None if tier is None else (tier.num_saved, tier.num_loaded)
    return PrefixCacheCounts(kv.prefix_queries, kv.prefix_hits, offload)


def _spec_decode_counts(engine: Any) -> SpecDecodeCounts | None:
    """The engine's speculative-decoding counters, if it has a drafter."""
    drafter = getattr(engine, "drafter", None)
    if drafter is None:
        return None
    st = engine.spec_stats
    # every position up to k from the start, so per-position series exist before any draft
    per_pos = list(st.accepted_per_position) + [0] * (drafter.k - len(st.accepted_per_position))
    return SpecDecodeCounts(
        st.num_spec_steps, st.num_draft_tokens, st.num_accepted_tokens, tuple(per_pos)
    )


class Histogram:
    """Cumulative-bucket histogram, as Prometheus exposes it."""

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
            out.append((_num(le), total))
        out.append(("+Inf", self.count))
        return out


def _num(value: float) -> str:
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """Token counters, finished-request counters and latency histograms of one server (or of
    one offline ``LLM``, for ``LLM.get_metrics``)."""

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

    def record_latencies(self, m: RequestMetrics | None) -> None:
        """Observe the latencies of one finished engine request (all of its samples)."""
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

    def render(self, gauges: EngineGauges) -> str:
        """The whole exposition text."""
        lbl = f'model_name="{_label(self.model_name)}"'
        lines: list[str] = []

        def header(name: str, kind: str, help_: str) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])

        with self._lock:
            for name, kind, help_, value in self._scalars(gauges):
                header(name, kind, help_)
                lines.append(f"{name}{{{lbl}}} {_num(value)}")
            name = "vllm:request_success_total"
            header(name, "counter", "Count of finished requests, by finish reason.")
            for reason, n in self.finished.items():
                lines.append(f'{name}{{finished_reason="{reason}",{lbl}}} {_num(n)}')
            for name, help_, h in self._histograms():
                header(name, "histogram", help_)
                lines.extend(
                    f'{name}_bucket{{le="{le}",{lbl}}} {_num(n)}' for le, n in h.cumulative()
                )
                lines.append(f"{name}_count{{{lbl}}} {_num(h.count)}")
                lines.append(f"{name}_sum{{{lbl}}} {_num(h.sum)}")
        for name, help_, value in _engine_counters(gauges):
            header(name, "counter", help_)
            lines.append(f"{name}{{{lbl}}} {_num(value)}")
        if gauges.lora is not None:  # as vLLM: the labels carry the state, the value a time
            name, lg = "vllm:lora_requests_info", gauges.lora
            header(name, "gauge", "Running stats on LoRA requests.")
            lines.append(
                f'{name}{{max_lora="{lg.max_lora}",'
                f'running_lora_adapters="{_label(",".join(lg.running))}",'
                f'waiting_lora_adapters="{_label(",".join(lg.waiting))}"}} {_num(gauges.time)}'
            )
        name = "vllm:engine_sleep_state"  # as vLLM: one line per state, 1 for the current one
        header(name, "gauge", "Engine sleep state: awake, weights_offloaded (level 1) or "
               "discard_all (level 2).")  # fmt: skip
        for level, state in enumerate(("awake", "weights_offloaded", "discard_all")):
            value = int(gauges.sleep_level == level)
            lines.append(f'{name}{{{lbl},sleep_state="{state}"}} {value}')
        if gauges.spec_decode is not None:
            name = PER_POSITION + "_total"  # a counter's samples end in _total
            header(name, "counter", "Accepted draft tokens, by position in the draft.")
            for pos, n in enumerate(gauges.spec_decode.accepted_per_position):
                lines.append(f'{name}{{{lbl},position="{pos}"}} {_num(n)}')
        return "\n".join(lines) + "\n"

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
            ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.",
             g.preemptions),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             self.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
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
    """(name, help, value) of the prefix-cache and speculative counters that are on."""
    out = []
    if g.prefix_cache is not None:
        out += [
            ("vllm:prefix_cache_queries_total",
             "Prefix cache queries, in KV blocks (vLLM counts tokens): full prompt blocks "
             "looked up.", g.prefix_cache.queries),
            ("vllm:prefix_cache_hits_total",
             "Prefix cache hits, in KV blocks (vLLM counts tokens): looked-up blocks found.",
             g.prefix_cache.hits),
        ]  # fmt: skip
    if g.prefix_cache is not None and g.prefix_cache.offload is not None:
        saved, loaded = g.prefix_cache.offload
        out += [
            ("paged_llm:kv_offload_saved_blocks_total",
             "Cached KV blocks copied from the device to the CPU tier (--kv-offloading-size) "
             "before their device block was reused.", saved),
            ("paged_llm:kv_offload_loaded_blocks_total",
             "KV blocks found in the CPU tier and copied back to the device.", loaded),
        ]  # fmt: skip
    if g.kv_transfer is not None:
        t = g.kv_transfer
        out += [
            ("paged_llm:kv_transfer_saved_blocks_total",
             "KV blocks this engine saved through its KV connector (kv_producer, kv_both).",
             t["blocks_saved"]),
            ("paged_llm:kv_transfer_loaded_blocks_total",
             "KV blocks this engine loaded through its KV connector instead of computing them.",
             t["blocks_loaded"]),
            ("paged_llm:kv_transfer_saved_bytes_total", "Bytes the KV connector wrote.",
             t["bytes_saved"]),
            ("paged_llm:kv_transfer_loaded_bytes_total", "Bytes the KV connector read.",
             t["bytes_loaded"]),
            ("paged_llm:kv_transfer_save_seconds_total",
             "Seconds spent saving KV blocks (inside engine steps).", t["seconds_saving"]),
            ("paged_llm:kv_transfer_load_seconds_total",
             "Seconds spent loading KV blocks (inside engine steps).", t["seconds_loading"]),
            ("paged_llm:kv_transfer_save_failures_total",
             "KV blocks that could not be saved (skipped; the step went on).",
             t["save_failures"]),
        ]  # fmt: skip
    if g.spec_decode is not None:
        s = g.spec_decode
        out += [
            ("vllm:spec_decode_num_drafts_total",
             "Number of spec decoding drafts (sequence-steps that verified draft tokens).",
             s.num_drafts),
            ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
             s.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
             s.num_accepted_tokens),
        ]  # fmt: skip
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value; for tests and quick scripts."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
