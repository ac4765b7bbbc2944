"""Iteration-level scheduling (plain Python, no torch).

Each ``schedule()`` call decides which requests run this step and how many tokens each
computes, under ``max_num_seqs`` and ``max_num_batched_tokens``. Requests join at any step and
leave the moment they finish. When the KV manager runs out of room, a running request is
preempted by recomputation or by swapping: the most recently admitted one, or with priority
scheduling the least urgent (``core/queue_policy.py`` holds that choice and the queue order).
"""

from __future__ import annotations

import logging
from collections import deque

from paged_llm.core.kv.base import KVCacheManager
from paged_llm.core.queue_policy import queue_policy_class
from paged_llm.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from paged_llm.core.scheduler_output import (  # re-exported: most code imports them from here
    IterationStats,
    ScheduledRequest,
    SchedulerLimits,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over a KV manager (paged, or a reservation baseline), in the order of
    a queue policy (first come first served, or priority)."""

    def __init__(self, kv: KVCacheManager, limits: SchedulerLimits, track_memory: bool = False):
        if limits.preemption_mode == "swap" and not kv.supports_swap:
            raise ValueError(f"policy '{kv.name}' does not support preemption_mode=swap")
        if not limits.enable_chunked_prefill and limits.max_num_batched_tokens < kv.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({limits.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({kv.max_model_len}); enable chunked prefill or raise it"
            )
        # Chunked prefill bounds what one request computes per step (a decode: 1 + lookahead),
        # which lets a sliding-window policy hold less than a request's whole length.
        step = max(limits.max_num_batched_tokens, 1 + limits.num_lookahead_slots)
        kv.bound_step_tokens(step if limits.enable_chunked_prefill else None)
        if kv.blocks_at_most(kv.max_model_len) > kv.num_blocks:
            raise ValueError(
                f"the KV pool holds {kv.num_slots} tokens, fewer than max_model_len "
                f"({kv.max_model_len}) needs; enlarge the cache or lower max_model_len"
            )
        # A reservation is one buddy run, which may be smaller than the pool.
        if kv.max_request_slots < kv.blocks_at_most(kv.max_model_len) * kv.block_size:
            raise ValueError(
                f"policy '{kv.name}' reserves one power-of-two run of blocks per request, and "
                f"the largest run of this {kv.num_blocks}-block pool holds "
                f"{kv.max_request_slots} tokens, fewer than max_model_len ({kv.max_model_len}); "
                "use a power-of-two number of blocks, enlarge the cache or lower max_model_len"
            )
        self.kv = kv
        self.limits = limits
        self.queue = queue_policy_class(limits.scheduling_policy)()
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

    def check_group_size(self, num_seqs: int, what: str) -> None:
        """ValueError when more sequences must run together than ``max_num_seqs`` (a group is
        admitted whole, so it would wait, or be preempted, forever)."""
        max_seqs = self.limits.max_num_seqs
        if num_seqs > max_seqs:
            raise ValueError(
                f"this request has {num_seqs} sequences ({what}) that run together, more "
                f"than max_num_seqs ({max_seqs}); lower {what} or raise max_num_seqs"
            )

    def check_group_fits(self, requests: list[Request], what: str) -> None:
        """ValueError when sequences scheduled and preempted together could never all run: more
        of them than ``max_num_seqs``, or more blocks than the pool."""
        self.check_group_size(len(requests), what)
        if len(requests) > 1 and not self.kv.group_fits_ever(requests):
            raise ValueError(
                f"the {len(requests)} sequences of this request ({what}) need up to "
                f"{self.kv.group_blocks_needed(requests)} KV blocks together (policy "
                f"'{self.kv.name}'), more than the pool of {self.kv.num_blocks} blocks can hold; "
                f"lower max_tokens or {what}, or enlarge the KV cache"
            )

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

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start ``child`` as a running sequence that shares the parent's blocks.

        The caller sets the child's tokens and ``num_computed_tokens`` (at most the parent's);
        both must carry the same ``group_id`` so they are preempted together.
        """
        if child.request_id in self.requests:
            raise ValueError(f"request id '{child.request_id}' is already in use")
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"can only fork a running request, {parent.request_id} is not")
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        self.requests[child.request_id] = child
        self.running.append(child)

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
        self.kv.plan_kv_saves(out.scheduled)  # a KV connector's producer saves this step's prompts
        out.block_ops = self.kv.take_block_ops()
        out.copy_blocks = [
            pair for kind, pairs in out.block_ops if kind == "copy" for pair in pairs
        ]
        out.stats = self._stats(out, now)
        return out

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute this step: all remaining, or a chunk with chunked prefill; 0 when
        the budget cannot take them (the request waits a step)."""
        n = req.num_tokens - req.num_computed_tokens
        if self.limits.enable_chunked_prefill:
            n = min(n, budget)
        return n if n <= budget else 0

    def drafts_next_step(self) -> bool:
        """Whether the next schedule reserves draft slots (given lookahead slots at all): not
        while at least ``spec_disable_batch_size`` requests run. The running set changes only
        inside schedule and update_from_output (and by aborts), so this predicts the next step."""
        cap = self.limits.spec_disable_batch_size
        return cap is None or len(self.running) < cap

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        drafting = bool(self.limits.num_lookahead_slots) and self.drafts_next_step()
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop together with its group
            if req.num_computed_tokens >= req.num_tokens or req.final_token_pending:
                continue  # up to date, waiting for an outside decision (a beam's next token)
            n = self._num_new_tokens(req, budget)
            if n == 0:
                break  # token budget exhausted; the rest wait a step
            look = self._lookahead(req, n, budget) if drafting else 0
            while not self.kv.allocate_slots(req, n + look):
                group = self._group_of(self.queue.victim(self.running))
                self._preempt(group, out)
                if req in group:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_table(req), look))
                budget -= n + look
        return budget

    def _lookahead(self, req: Request, n: int, budget: int) -> int:
        """Draft slots for a decode: all of num_lookahead_slots if the budget and length allow."""
        look = self.limits.num_lookahead_slots
        if not look or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        room = req.max_total_tokens - req.num_tokens  # never draft past the request's end
        return max(0, min(look, room, budget - n))

    def _group_of(self, req: Request) -> list[Request]:
        """The running sequences preempted together with ``req`` (its group, in order)."""
        if req.group_id is None:
            return [req]
        return [r for r in self.running if r.group_id == req.group_id]

    def _preempt(self, group: list[Request], out: SchedulerOutput) -> None:
        if any(s.request in group for s in out.scheduled):  # a member already got this step
            out.scheduled = [s for s in out.scheduled if s.request not in group]
        for req in group:
            self.running.remove(req)
            req.num_preemptions += 1
        self.num_preemptions_total += 1
        free_blocks = self.kv.num_free_blocks()
        mapping = self.kv.swap_out(group) if self.limits.preemption_mode == "swap" else None
        names = ",".join(r.request_id for r in group)
        if mapping is not None:
            for req in group:
                req.status = RequestStatus.SWAPPED
            self.queue.add_swapped(self.swapped, group)
            out.swap_out.extend(mapping)
            how = f"swapped out ({len(mapping)} blocks)"
        else:
            if self.limits.preemption_mode == "swap":
                logger.warning("swap space full: recomputing request(s) %s instead", names)
            for req in reversed(group):
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
            self.queue.requeue(self.waiting, group)
            how = "preempted for recomputation"
        out.preempted.extend(r.request_id for r in group)
        # like vLLM: warn on the first preemption and every 50th, so overload stays readable
        n = self.num_preemptions_total
        log = logger.warning if n == 1 or n % 50 == 0 else logger.debug
        log(
            "request %s %s: the KV cache is out of blocks (%d of %d free); "
            "total preemptions %d. Raise the KV cache size or lower max_num_seqs to avoid this.",
            names,
            how,
            free_blocks,
            self.kv.num_blocks,
            n,
        )

    def _running_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_fits(self, group: list[Request], running_loras: set[int]) -> bool:
        """False when the group's adapter would make more than max_loras distinct adapters
        run together (it then waits until one of them finishes, as in vLLM)."""
        lora = group[0].lora_int_id  # a group shares its prompt, hence its adapter
        if not lora or not self.limits.max_loras or lora in running_loras:
            return True
        return len(running_loras) < self.limits.max_loras

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped:
            group = self.swapped[0]
            if len(self.running) + len(group) > self.limits.max_num_seqs:
                break
            if not self._lora_fits(group, self._running_loras()):
                break
            counts = self._group_token_counts(group, budget)
            if counts is None or not self.kv.can_swap_in(group, max(counts)):
                break
            out.swap_in.extend(self.kv.swap_in(group))
            self.swapped.popleft()
            for req, n in zip(group, counts):
                ok = self.kv.allocate_slots(req, n)
                assert ok, "can_swap_in promised room for the swapped blocks and the new tokens"
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if n:
                    out.scheduled.append(ScheduledRequest(req, n, self.kv.get_block_table(req)))
                budget -= n
        return budget

    def _group_token_counts(self, group: list[Request], budget: int) -> list[int] | None:
        """Tokens each member of a group computes this step, sharing the budget in order; None
        when the first gets none. Later members may get 0 and go on as running requests in
        the next steps: the group's prompts (after a recomputation, each member's whole
        sequence) can need more tokens than one step's budget, and a group that waited for a
        step that could take all of them would wait forever."""
        counts: list[int] = []
        for req in group:
            counts.append(self._num_new_tokens(req, budget - sum(counts)))
        return counts if counts[0] > 0 else None

    def _may_admit(self) -> bool:
        if not self.kv.static_batching:
            return True
        if not self.running:
            self._batch_open = True
        return self._batch_open

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        loras = self._running_loras()
        skipped: set[int] = set()  # adapters with no free slot this step: their requests wait
        while self.waiting and self._may_admit():
            # the first waiting request whose adapter may run; later ones keep their order
            head = next((r for r in self.waiting if r.lora_int_id not in skipped), None)
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
            if not self._lora_fits(group, loras):
                skipped.add(head.lora_int_id)
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
            if head.lora_int_id:
                loras.add(head.lora_int_id)
        if self.kv.static_batching and not self.waiting:
            self._batch_open = False

    def _admit(self, group: list[Request], budget: int) -> list[int] | None:
        """Give every member its slots for this step (a later member may get 0 tokens, see
        ``_group_token_counts``), or roll back and return None."""
        counts: list[int] = []
        for req in group:
            self.kv.prepare_admission(req)
            n = self._num_new_tokens(req, budget - sum(counts))
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
            # Blocks of draft tokens may hold rejected KV: registered only after the truncation
            # below. Others join the prefix cache now, also when the request ends this step.
            drafted = bool(s.num_lookahead or req.spec_token_ids)
            if not drafted:
                self.kv.on_computed(req)
            if req.is_pooling and req.num_computed_tokens >= req.num_prompt_tokens:
                self._finish(req, RequestStatus.FINISHED_STOPPED, now)  # pooled this step
                finished.append(req)
                continue
            tokens = sampled.get(req.request_id, ())
            for token in tokens:
                if token == PLACEHOLDER_TOKEN:  # still on the device: resolve_placeholders
                    req.output_token_ids.append(token)
                    req.final_token_pending = req.num_output_tokens >= req.max_output_tokens
                    break
                req.append_token(token, now)
                status = req.check_stop()
                if status is not None:
                    self._finish(req, status, now)
                    finished.append(req)
                    break
            if req.is_finished or not drafted:
                continue
            # rejected drafts: their KV is invalid, so the count of computed tokens stops before
            # the newest token, and blocks past it go back to the pool
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            req.spec_token_ids = []
            self.kv.truncate(req, req.num_tokens)
            self.kv.on_computed(req)
        return finished

    def resolve_placeholders(self, tokens: list[tuple[Request, int]], now: float) -> list[Request]:
        """Async scheduling: write each request's sampled token over the placeholder that
        ``update_from_output`` appended (a step later, the next step already planned and
        launched) and finish requests it stops; return the finished. A request aborted or
        finished since keeps its outputs as they are."""
        finished = []
        for req, token in tokens:
            if req.is_finished:
                continue
            if req.output_token_ids[-1] != PLACEHOLDER_TOKEN:
                raise RuntimeError(f"request {req.request_id} has no placeholder to resolve")
            req.output_token_ids.pop()
            req.final_token_pending = False
            req.append_token(token, now)
            status = req.check_stop()
            if status is not None:
                self._finish(req, status, now)
                finished.append(req)
        return finished


__all__ = ["IterationStats", "ScheduledRequest", "Scheduler", "SchedulerLimits", "SchedulerOutput"]
