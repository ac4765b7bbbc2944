"""Iteration-level scheduling (plain Python, no torch).

Each ``schedule()`` call decides which requests run this step and how many tokens each
computes, under ``max_num_seqs`` and ``max_num_batched_tokens``. Requests join at any step and
leave the moment they finish. When the KV manager runs out of room, a running request is
preempted by recomputation or by swapping (``core/preemption.py``, chosen by
``preemption_mode``): the most recently admitted one, or with priority scheduling the least
urgent (``core/queue_policy.py`` holds that choice and the queue order). A LoRA limit
(``core/lora_limit.py``) and speculative decoding's draft slots (``core/draft_slots.py``) are
chosen when the scheduler is built; async scheduling's placeholders are ``core/placeholders.py``.
A step's result is a ``SchedulerOutput`` (defined here, with its telemetry); the limits are
``core/scheduler_limits.py``'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_llm.core.draft_slots import DraftSlots
from paged_llm.core.kv.base import KVCacheManager
from paged_llm.core.kv.stats import MemoryBreakdown
from paged_llm.core.lora_limit import LoraLimit
from paged_llm.core.placeholders import hold_placeholder, resolve_placeholders
from paged_llm.core.preemption import PREEMPTION_MODES
from paged_llm.core.queue_policy import queue_policy_class
from paged_llm.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from paged_llm.core.scheduler_limits import SchedulerLimits, bind_limits
from paged_llm.core.sequence_groups import SequenceGroups

# ---- what the scheduler gives each step: what the runner computes and which blocks move ----


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int
    block_table: list[int]
    num_lookahead: int = 0  # slots allocated beyond num_new_tokens for draft tokens

    @property
    def samples(self) -> bool:
        """True when this step completes the request's known tokens, so it samples one more
        (never for a pooling request: it pools instead)."""
        r = self.request
        return not r.is_pooling and r.num_computed_tokens + self.num_new_tokens >= r.num_tokens


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
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # all block moves above, in the order the runner must apply them (see take_block_ops)
    block_ops: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    stats: IterationStats | None = None

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when no request runs and no blocks move."""
        return not (self.scheduled or self.swap_in or self.swap_out or self.copy_blocks)


class Scheduler(SequenceGroups):
    """Continuous batching over a KV manager (paged, or a reservation baseline), in the order of
    a queue policy (first come first served, or priority). Groups of sequences (samples,
    beams) are checked and forked by ``SequenceGroups`` (core/sequence_groups.py)."""

    def __init__(self, kv: KVCacheManager, limits: SchedulerLimits, track_memory: bool = False):
        bind_limits(kv, limits)  # refuses limits the pool cannot serve (core/scheduler_limits.py)
        self.kv = kv
        self.limits = limits
        self.queue = queue_policy_class(limits.scheduling_policy)()
        self.preemption = PREEMPTION_MODES[limits.preemption_mode](self)  # core/preemption.py
        self.lora_limit = LoraLimit(self) if limits.max_loras else AnyAdapter()
        self.drafts = DraftSlots(self) if limits.num_lookahead_slots else NoDrafts(self)
        self.track_memory = track_memory
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; self.queue picks the victim
        self.swapped: deque[list[Request]] = deque()  # groups swapped out together
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
        self.queue.add(self.waiting, request)

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
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        for group in list(self.swapped):
            if req in group:
                group.remove(req)
                if not group:
                    self.swapped.remove(group)
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
            if self.swapped:  # only a swapping strategy fills it
                budget = self.preemption.resume(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget, now)
        self.kv.plan_kv_saves(out.scheduled)  # a KV connector's producer saves this step's prompts
        out.block_ops = self.kv.take_block_ops()
        out.copy_blocks = [
            pair for kind, pairs in out.block_ops if kind == "copy" for pair in pairs
        ]
        out.stats = self._stats(out, now)
        return out

    def num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute this step: all remaining, or a chunk with chunked prefill; 0 when
        the budget cannot take them (the request waits a step)."""
        n = req.num_tokens - req.num_computed_tokens
        if self.limits.enable_chunked_prefill:
            n = min(n, budget)
        return n if n <= budget else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.drafts.begin()
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop together with its group
            if req.num_computed_tokens >= req.num_tokens or req.final_token_pending:
                continue  # up to date, waiting for an outside decision (a beam's next token)
            n = self.num_new_tokens(req, budget)
            if n == 0:
                break  # token budget exhausted; the rest wait a step
            look = self.drafts.slots(req, n, budget)
            fits = self.kv.allocate_slots(req, n + look)
            if not fits and not self.preemption.make_room(req, n + look, out):
                continue  # req's own group was preempted
            out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_table(req), look))
            budget -= n + look
        return budget

    def _may_admit(self) -> bool:
        if not self.kv.static_batching:
            return True
        if not self.running:
            self._batch_open = True
        return self._batch_open

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        gate = self.lora_limit
        gate.begin()
        while self.waiting and self._may_admit():
            head = gate.next_head(self.waiting)
            if head is None:
                break
            # a group (samples or beams back from recomputation) is admitted whole, or a part of
            # it would sit on its blocks waiting for the rest forever
            group = (
                [head] if head.group_id is None
                else [r for r in self.waiting if r.group_id == head.group_id]
            )  # fmt: skip
            if len(self.running) + len(group) > self.limits.max_num_seqs:
                self._batch_open = False
                break
            if not gate.admits(group):
                continue
            counts = self._admit(group, budget)
            if counts is None:
                break
            for req, n in zip(group, counts):
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                self.running.append(req)
                if n:
                    out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_table(req)))
                budget -= n
            gate.admitted(group)
        if self.kv.static_batching and not self.waiting:
            self._batch_open = False

    def _admit(self, group: list[Request], budget: int) -> list[int] | None:
        """Give every member its slots for this step (a later member may get 0 tokens, see
        ``_group_token_counts``), or roll back and return None."""
        counts: list[int] = []
        for req in group:
            self.kv.prepare_admission(req)
            n = self.num_new_tokens(req, budget - sum(counts))
            may_wait = bool(counts)  # members after the first may start in a later step
            ok = (
                (n > 0 or may_wait) and self.kv.can_admit(req, n) and self.kv.allocate_slots(req, n)
            )
            counts.append(n)
            if not ok:
                for r in group[: len(counts)]:
                    self.kv.cancel_admission(r)
                    self.kv.free(r)
                    r.num_computed_tokens = 0
                if n > 0:  # out of memory rather than out of token budget
                    self._batch_open = False
                return None
        return counts

    def _stats(self, out: SchedulerOutput, now: float) -> IterationStats:
        return IterationStats(
            now=now,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=sum(len(g) for g in self.swapped),
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
            self.drafts.update(s, sampled.get(req.request_id, ()), now)
            if req.is_finished:
                finished.append(req)
        return finished

    def take_tokens(self, s: ScheduledRequest, tokens: Sequence[int], now: float) -> None:
        """Take a request's tokens of this step, its computed count already advanced: its
        blocks join the prefix cache (also when it ends now), a pooling request finishes."""
        req = s.request
        self.kv.on_computed(req)
        if req.is_pooling and req.num_computed_tokens >= req.num_prompt_tokens:
            self._finish(req, RequestStatus.FINISHED_STOPPED, now)  # pooled this step
            return
        self.append_tokens(req, tokens, now)

    def append_tokens(self, req: Request, tokens: Sequence[int], now: float) -> None:
        """Append sampled tokens until one stops the request (then finish it)."""
        for token in tokens:
            if token == PLACEHOLDER_TOKEN:  # still on the device (core/placeholders.py)
                hold_placeholder(req)
                return
            req.append_token(token, now)
            status = req.check_stop()
            if status is not None:
                self._finish(req, status, now)
                return

    def resolve_placeholders(self, tokens: list[tuple[Request, int]], now: float) -> list[Request]:
        """Async scheduling: write the sampled tokens over their placeholders and finish the
        requests they stop; return the finished (core/placeholders.py)."""
        return resolve_placeholders(self, tokens, now)


class AnyAdapter:
    """No LoRA limit: admission takes the waiting queue in order (``core/lora_limit.py`` is
    the gate under ``max_loras``)."""

    def begin(self) -> None:
        """Nothing to count."""

    def next_head(self, waiting: deque[Request]) -> Request:
        """The head of the queue."""
        return waiting[0]

    def admits(self, group: list[Request]) -> bool:
        """Every group."""
        return True

    def admitted(self, group: list[Request]) -> None:
        """Nothing to count."""

    def fits_running(self, group: list[Request]) -> bool:
        """Every group."""
        return True


class NoDrafts:
    """Without speculative decoding: no draft slots, and each step's tokens taken as sampled
    (``core/draft_slots.py`` is the strategy with lookahead slots)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.update = scheduler.take_tokens

    def begin(self) -> None:
        """Nothing to decide."""

    def slots(self, req: Request, n: int, budget: int) -> int:
        """None."""
        return 0


__all__ = ["IterationStats", "ScheduledRequest", "Scheduler", "SchedulerLimits", "SchedulerOutput"]
