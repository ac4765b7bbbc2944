"""Request arrivals: Poisson (or gamma-bursty) arrival times and the timed request list that
both the real and the simulated executors replay (plain Python, no torch).

Every request generates exactly its trace output length (``ignore_eos``), as in the paper's
artifact; prompt token ids are arbitrary, only their number matters. A request may ask for
several sequences that share memory (parallel samples, beam search) or start with a prompt
prefix common to the whole workload; both executors run those (the simulated one through
paged_llm/sim/groups.py, the real one on the engine's own forks and prefix cache).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from paged_llm.workloads.conversations import conversation_pairs, conversation_turns
from paged_llm.workloads.lengths import LengthPair, sample_pairs
from paged_llm.workloads.traces import LengthSource, length_source


@dataclass(frozen=True)
class TimedRequest:
    """One request of a workload: its lengths and when it arrives (seconds from the start)."""

    request_id: str
    input_len: int
    output_len: int
    arrival_time: float
    n: int = 1  # parallel samples (SamplingParams.n)
    beam_width: int = 1  # > 1: beam search of this width
    prefix_len: int = 0  # the first prefix_len prompt tokens are the same in every request
    priority: int = 0  # with scheduling_policy="priority": smaller runs sooner
    # a turn of a multi-turn conversation (-1: none): its prompt is the conversation's earlier
    # messages and replies, of these lengths in order (message, reply, message, ...), then this
    # turn's message (see workloads/conversations.py, conversation_turns)
    conversation: int = -1
    history: tuple[int, ...] = ()


@dataclass
class Workload:
    """A replayable list of timed requests plus where its lengths came from."""

    requests: list[TimedRequest]
    source: str  # e.g. "trace:/path/sharegpt.csv" or "synthetic:sharegpt"
    synthetic: bool
    request_rate: float
    name: str = "workload"
    meta: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """Summary for result files: source, synthetic flag, size, rate and mean lengths."""
        n = len(self.requests) or 1
        return {
            "name": self.name,
            "source": self.source,
            "synthetic": self.synthetic,
            "num_requests": len(self.requests),
            "request_rate": self.request_rate,
            "mean_input_len": sum(r.input_len for r in self.requests) / n,
            "mean_output_len": sum(r.output_len for r in self.requests) / n,
            "last_arrival_s": self.requests[-1].arrival_time if self.requests else 0.0,
            **self.meta,
        }


def _gaps(rng: random.Random, request_rate: float, burstiness: float):
    """Inter-arrival gaps: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf for all-at-once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        while True:
            yield 0.0
    # vLLM's benchmark_serving: shape = burstiness, scale = 1 / (rate * burstiness), so the
    # mean gap stays 1/rate while the coefficient of variation is 1/sqrt(burstiness).
    scale = 1.0 / (request_rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def arrival_times(
    num_requests: int, request_rate: float, seed: int, burstiness: float = 1.0
) -> list[float]:
    """Arrival times of ``num_requests`` requests; the first arrives after one gap."""
    rng = random.Random(seed)
    gaps = _gaps(rng, request_rate, burstiness)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += next(gaps)
        times.append(t)
    return times


def arrivals_within(
    duration_s: float, request_rate: float, seed: int, burstiness: float = 1.0
) -> list[float]:
    """All arrival times in [0, duration_s) of the process (a trace of fixed length in time)."""
    if math.isinf(request_rate):
        raise ValueError("a duration-limited trace needs a finite request_rate")
    rng = random.Random(seed)
    gaps = _gaps(rng, request_rate, burstiness)
    t, times = next(gaps), []
    while t < duration_s:
        times.append(t)
        t += next(gaps)
    return times


def timed_requests(
    pairs: list[LengthPair], times: list[float], seed: int, prefix: str = ""
) -> list[TimedRequest]:
    """Pair each arrival time with a length pair drawn (seeded) from ``pairs``."""
    chosen = sample_pairs(pairs, len(times), seed) if times else []
    return [
        TimedRequest(f"{prefix}{i}", p.input_len, p.output_len, t)
        for i, (p, t) in enumerate(zip(chosen, times))
    ]


def prompt_token_ids(request: TimedRequest, vocab_size: int | None = None) -> list[int]:
    """Arbitrary prompt ids of the right length: zeros like the artifact, or a fixed pattern
    that avoids the first three (special) ids when a vocabulary size is given."""
    if vocab_size is None:
        return [0] * request.input_len
    span = max(1, vocab_size - 3)
    return [3 + (i * 7919) % span for i in range(request.input_len)]


# How a simulated beam search picks the parent of each new beam: "uniform" (each at random
# among the live beams: the neutral model), "best" (all from one beam: the most sharing),
# "own" (beam i always extends beam i: beams share only the prompt, the least sharing).
# "measured": each new beam of rank i picks its parent's rank from the distribution that
# experiments/beam_sharing.py recorded for real beam search with a trained model
# (paged_llm/sim/data/beam_parent_ranks.json).
BEAM_PARENTS = ("uniform", "best", "own", "measured")


# ---- a workload from a spec (the ``workload`` config group) ------------------------------------
@dataclass(frozen=True)
class WorkloadSpec:
    """Where lengths come from and how requests arrive; one of duration_s / num_requests."""

    name: str = "sharegpt"
    path: str | None = None  # CSV / artifact pickle / ShareGPT JSON; None: synthetic lengths
    synthetic: str = "sharegpt"  # the distribution used when there is no path
    tokenizer: str | None = None  # for ShareGPT JSON only
    request_rate: float = 1.0  # requests per second (inf: all at time 0)
    duration_s: float | None = 600.0  # arrivals in [0, duration_s)
    num_requests: int | None = None  # or a fixed number of requests
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    seed: int = 0
    max_total_len: int = 2048  # keep input + output < this (the paper's filter)
    min_input_len: int = 1
    min_output_len: int = 1
    length_scale: float = 1.0  # shrink lengths for small-model runs
    # ---- memory sharing (Fig. 14-17) ----
    n: int = 1  # parallel samples per request
    beam_width: int = 1  # > 1: every request is a beam search of this width
    # which live beam each new beam extends (simulation has no logits; paged_llm/sim/groups.py)
    beam_parents: str = "uniform"
    prefix_len: int = 0  # a prefix of this many tokens, the same for all, before every prompt
    chat_turns: float = 0.0  # > 0: chatbot prompts with this mean number of earlier turns
    max_prompt_len: int | None = None  # keep only the last tokens of longer prompts
    max_output_len: int | None = None  # cap output lengths
    # ---- multi-turn conversations (prefix caching across turns, the KV offload tier) ----
    # > 0: each arrival starts a conversation of up to this many turns, each a request whose
    # prompt is the whole conversation so far; request_rate is then conversations per second
    turns: int = 0
    think_time_s: float = 30.0  # mean gap (exponential) between a turn's arrival and the next's

    def __post_init__(self) -> None:
        if self.n < 1 or self.beam_width < 1 or self.prefix_len < 0 or self.chat_turns < 0:
            raise ValueError("need n >= 1, beam_width >= 1, prefix_len >= 0 and chat_turns >= 0")
        if self.turns < 0 or not self.think_time_s >= 0:
            raise ValueError("need turns >= 0 and think_time_s >= 0")
        if self.turns and self.shapes_requests:
            raise ValueError("multi-turn conversations (turns) do not combine with n, "
                             "beam_width, prefix_len, chat_turns or the length caps")  # fmt: skip
        if self.n > 1 and self.beam_width > 1:
            raise ValueError("give either n (parallel sampling) or beam_width, not both")
        if self.beam_parents not in BEAM_PARENTS:
            raise ValueError(f"beam_parents must be one of {BEAM_PARENTS}, got {self.beam_parents}")

    @property
    def shapes_requests(self) -> bool:
        """True when any sharing / chatbot / cut option changes the plain trace requests."""
        return (self.n, self.beam_width, self.prefix_len, self.chat_turns) != (1, 1, 0, 0.0) or (
            self.max_prompt_len is not None or self.max_output_len is not None
        )


def shape_requests(requests: list[TimedRequest], spec: WorkloadSpec) -> list[TimedRequest]:
    """Cut prompts (to their last max_prompt_len tokens) and outputs, prepend the shared prefix,
    and set the sequences each request asks for."""
    out = []
    for r in requests:
        inp = r.input_len if spec.max_prompt_len is None else min(r.input_len, spec.max_prompt_len)
        o = r.output_len if spec.max_output_len is None else min(r.output_len, spec.max_output_len)
        shaped = replace(
            r, input_len=spec.prefix_len + inp, output_len=o, n=spec.n,
            beam_width=spec.beam_width, prefix_len=spec.prefix_len,
        )  # fmt: skip
        out.append(shaped)
    return out


@lru_cache(maxsize=8)
def _cached_lengths(
    path: str | None,
    synthetic: str,
    tokenizer: str | None,
    max_total_len: int,
    min_input_len: int,
    min_output_len: int,
    length_scale: float,
    seed: int,
) -> LengthSource:
    # Sweeps build many workloads from one trace; reading an 84K-row CSV once is enough.
    return length_source(
        path, synthetic, tokenizer, max_total_len, min_input_len, min_output_len,
        length_scale, seed=seed,
    )  # fmt: skip


def build_workload(spec: WorkloadSpec | dict[str, Any]) -> Workload:
    """Timed requests for a spec: filtered trace (or synthetic) lengths at seeded arrivals."""
    if not isinstance(spec, WorkloadSpec):
        spec = WorkloadSpec(**spec)
    source = _cached_lengths(
        spec.path, spec.synthetic, spec.tokenizer, spec.max_total_len, spec.min_input_len,
        spec.min_output_len, float(spec.length_scale), spec.seed,
    )  # fmt: skip
    rate = float(spec.request_rate)
    if spec.num_requests is not None:
        times = arrival_times(spec.num_requests, rate, spec.seed, spec.burstiness)
    elif spec.duration_s is not None:
        times = arrivals_within(spec.duration_s, rate, spec.seed, spec.burstiness)
    else:
        raise ValueError("a workload needs duration_s or num_requests")
    pairs = source.pairs
    meta: dict[str, Any] = {
        "burstiness": spec.burstiness, "seed": spec.seed, "duration_s": spec.duration_s
    }  # fmt: skip
    if spec.chat_turns > 0:
        pairs = conversation_pairs(pairs, len(times), spec.seed + 2, spec.chat_turns)
    if spec.turns:
        turns = conversation_turns(pairs, times, spec.seed + 3, spec.turns, spec.think_time_s,
                                   spec.max_total_len)  # fmt: skip
        requests = [TimedRequest(f"c{t.conversation}-t{t.index}", t.prompt_len, t.reply_len,
                                 t.arrival_time, conversation=t.conversation, history=t.history)
                    for t in turns]  # fmt: skip
        meta.update(turns=spec.turns, think_time_s=spec.think_time_s)
    else:
        requests = timed_requests(pairs, times, spec.seed + 1)
    if spec.shapes_requests:
        requests = shape_requests(requests, spec)
        keys = ("n", "beam_width", "prefix_len", "chat_turns", "max_prompt_len", "max_output_len")
        meta.update({k: getattr(spec, k) for k in keys})
        if spec.beam_width > 1:
            meta["beam_parents"] = spec.beam_parents
    return Workload(
        requests=requests,
        source=source.label,
        synthetic=source.synthetic,
        request_rate=rate,
        name=spec.name,
        meta=meta,
    )
