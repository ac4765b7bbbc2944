"""Iteration-level scheduling (plain Python, no torch).

Each ``schedule()`` call decides which requests run this step and how many tokens each
computes, under ``max_num_seqs`` and ``max_num_batched_tokens``. Requests join at any step and
leave the moment they finish. When the KV manager runs out of room, the most recently admitted
running request is preempted by recomputation or by swapping.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from paged_llm.core.kv.base import KVCacheManager, MemoryBreakdown
from paged_llm.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    """Batch limits of the scheduler (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"  # "recompute" or "swap"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got '{self.preemption_mode}'"
            )


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """True when this step completes the request's known tokens, so it samples one more."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens >= r.num_tokens


@dataclass
class IterationStats:
    """Telemetry of one step, for logs and experiments."""

    now: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_batched_tokens: int
    kv_usage: float
    num_preemptions: int
    swap_in_blocks: int
    swap_out_blocks: int
    memory: MemoryBreakdown | None = None


@dataclass
class SchedulerOutput:
    """What the model runner must do this step."""

    scheduled: list[ScheduledRequest]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    preempted: list[str] = field(default_factory=list)
    stats: IterationStats | None = None

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when no request runs and no blocks move."""
        return not (self.scheduled or self.swap_in or self.swap_out)


class Scheduler:
    """FCFS continuous batching over a KV manager (paged, or a reservation baseline)."""

    def __init__(self, kv: KVCacheManager, limits: SchedulerLimits, track_memory: bool = False):
        if limits.preemption_mode == "swap" and not kv.supports_swap:
            raise ValueError(f"policy '{kv.name}' does not support preemption_mode=swap")
        if not limits.enable_chunked_prefill and limits.max_num_batched_tokens < kv.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({limits.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({kv.max_model_len}); enable chunked prefill or raise it"
            )
        if kv.num_slots < kv.max_model_len:
            raise ValueError(
                f"the KV pool holds {kv.num_slots} tokens, fewer than max_model_len "
                f"({kv.max_model_len}); enlarge the cache or lower max_model_len"
            )
        self.kv = kv
        self.limits = limits
        self.track_memory = track_memory
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._batch_open = True  # static batching: is the current batch still taking requests?

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; reject at once one that could never fit the pool."""
        if request.request_id in self.requests:
            raise ValueError(f"request id '{request.request_id}' is already in use")
        if not self.kv.fits_ever(request):
            raise ValueError(
                f"request {request.request_id} needs more KV cache than the whole pool "
                f"({self.kv.num_slots} slots of policy '{self.kv.name}'); it can never run"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and release its blocks."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED, now=None)
        return req

    def finish_request(self, request_id: str, status: RequestStatus, now: float) -> None:
        """Finish a request for a reason found outside the scheduler (e.g. a stop string)."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self._finish(req, status, now)

    def _finish(self, req: Request, status: RequestStatus, now: float | None) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        self.kv.free(req)
        req.status = status
        req.finished_time = now
        del self.requests[req.request_id]

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Choose this step's requests and token counts; preempt if the pool is exhausted."""
        out = SchedulerOutput(scheduled=[])
        budget = self.limits.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget, now)
        out.stats = self._stats(out, now)
        return out

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if self.limits.enable_chunked_prefill:
            n = min(n, budget)
        return n if n <= budget else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                break  # token budget exhausted; the rest wait a step
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_table(req)))
                budget -= n
                i += 1
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        free_blocks = self.kv.num_free_blocks()
        mapping = self.kv.swap_out(req) if self.limits.preemption_mode == "swap" else None
        if mapping is not None:
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            out.swap_out.extend(mapping)
            how = f"swapped out ({len(mapping)} blocks)"
        else:
            if self.limits.preemption_mode == "swap":
                logger.warning("swap space full: recomputing request %s instead", req.request_id)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            how = "preempted for recomputation"
        out.preempted.append(req.request_id)
        logger.warning(
            "request %s %s: the KV cache is out of blocks (%d of %d free); "
            "total preemptions %d. Raise the KV cache size or lower max_num_seqs to avoid this.",
            req.request_id,
            how,
            free_blocks,
            self.kv.num_blocks,
            self.num_preemptions_total,
        )

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and len(self.running) < self.limits.max_num_seqs:
            req = self.swapped[0]
            n = self._num_new_tokens(req, budget)
            if n == 0 or not self.kv.can_swap_in(req, n):
                break
            mapping = self.kv.swap_in(req)
            ok = self.kv.allocate_slots(req, n)
            assert ok, "can_swap_in promised room for the swapped blocks and the new tokens"
            self.swapped.popleft()
            out.swap_in.extend(mapping)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_table(req)))
            budget -= n
        return budget

    def _may_admit(self) -> bool:
        if not self.kv.static_batching:
            return True
        if not self.running:
            self._batch_open = True
        return self._batch_open

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        while self.waiting and self._may_admit():
            if len(self.running) >= self.limits.max_num_seqs:
                self._batch_open = False
                break
            req = self.waiting[0]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                break
            if not (self.kv.can_admit(req, n) and self.kv.allocate_slots(req, n)):
                self._batch_open = False
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_table(req)))
            budget -= n
        if self.kv.static_batching and not self.waiting:
            self._batch_open = False

    def _stats(self, out: SchedulerOutput, now: float) -> IterationStats:
        return IterationStats(
            now=now,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_batched_tokens=out.num_batched_tokens,
            kv_usage=self.kv.usage(),
            num_preemptions=len(out.preempted),
            swap_in_blocks=len(out.swap_in),
            swap_out_blocks=len(out.swap_out),
            memory=self.kv.memory_breakdown(self.running) if self.track_memory else None,
        )

    # ---- after the model ran ------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], now: float
    ) -> list[Request]:
        """Advance counters, append sampled tokens, and finish requests; return the finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted between schedule and update
                continue
            req.num_computed_tokens += s.num_new_tokens
            for token in sampled.get(req.request_id, ()):
                req.append_token(token, now)
                status = req.check_stop()
                if status is not None:
                    self._finish(req, status, now)
                    finished.append(req)
                    break
        return finished
