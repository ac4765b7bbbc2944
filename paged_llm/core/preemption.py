"""Preemption (plain Python, no torch): what the scheduler does when the KV pool cannot give a
running request the slots it needs this step.

The queue policy picks a victim; its whole group (parallel samples, beams) gives up its blocks,
either freed to be recomputed later (``RecomputePreemption``) or moved to the CPU swap pool and
brought back once there is room (``SwapPreemption``). ``SchedulerLimits.preemption_mode``
chooses one when the scheduler is built, so a step that preempts nothing never enters this
module.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from paged_llm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from paged_llm.core.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("paged_llm.core.scheduler")  # the scheduler's log, as before the split


class RecomputePreemption:
    """Free a preempted group's blocks; the group waits and recomputes its tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler

    def make_room(self, req: Request, num_slots: int, out: SchedulerOutput) -> bool:
        """Preempt victim groups until ``req`` gets ``num_slots`` more slots (True), or until
        ``req``'s own group is preempted (False)."""
        sched = self.sched
        while True:
            group = self._group_of(sched.queue.victim(sched.running))
            self._preempt(group, out)
            if req in group:
                return False
            if sched.kv.allocate_slots(req, num_slots):
                return True

    def resume(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule swapped groups back; return the budget left (nothing is ever swapped)."""
        return budget

    def _group_of(self, req: Request) -> list[Request]:
        """The running sequences preempted together with ``req`` (its group, in order)."""
        if req.group_id is None:
            return [req]
        return [r for r in self.sched.running if r.group_id == req.group_id]

    def _preempt(self, group: list[Request], out: SchedulerOutput) -> None:
        sched = self.sched
        if any(s.request in group for s in out.scheduled):  # a member already got this step
            out.scheduled = [s for s in out.scheduled if s.request not in group]
        for req in group:
            sched.running.remove(req)
            req.num_preemptions += 1
        sched.num_preemptions_total += 1
        free_blocks = sched.kv.num_free_blocks()
        how = self._release(group, out)
        out.preempted.extend(r.request_id for r in group)
        # like vLLM: warn on the first preemption and every 50th, so overload stays readable
        n = sched.num_preemptions_total
        log = logger.warning if n == 1 or n % 50 == 0 else logger.debug
        log(
            "request %s %s: the KV cache is out of blocks (%d of %d free); "
            "total preemptions %d. Raise the KV cache size or lower max_num_seqs to avoid this.",
            _names(group),
            how,
            free_blocks,
            sched.kv.num_blocks,
            n,
        )

    def _release(self, group: list[Request], out: SchedulerOutput) -> str:
        """Give up the group's blocks; return how, for the log."""
        sched = self.sched
        for req in reversed(group):
            sched.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
        sched.queue.requeue(sched.waiting, group)
        return "preempted for recomputation"


class SwapPreemption(RecomputePreemption):
    """Move a preempted group's blocks to the CPU swap pool (recompute when it is full), and
    bring swapped groups back, oldest first, before any waiting request is admitted."""

    def _release(self, group: list[Request], out: SchedulerOutput) -> str:
        sched = self.sched
        mapping = sched.kv.swap_out(group)
        if mapping is None:
            logger.warning("swap space full: recomputing request(s) %s instead", _names(group))
            return super()._release(group, out)
        for req in group:
            req.status = RequestStatus.SWAPPED
        sched.queue.add_swapped(sched.swapped, group)
        out.swap_out.extend(mapping)
        return f"swapped out ({len(mapping)} blocks)"

    def resume(self, out: SchedulerOutput, budget: int) -> int:
        """Swap groups back in while they fit the sequence limit, the LoRA limit, the token
        budget and the pool; return the budget left."""
        from paged_llm.core.scheduler import ScheduledRequest  # scheduler.py imports this module

        sched = self.sched
        while sched.swapped:
            group = sched.swapped[0]
            if len(sched.running) + len(group) > sched.limits.max_num_seqs:
                break
            if not sched.lora_limit.fits_running(group):
                break
            counts = self._group_token_counts(group, budget)
            if counts is None or not sched.kv.can_swap_in(group, max(counts)):
                break
            out.swap_in.extend(sched.kv.swap_in(group))
            sched.swapped.popleft()
            for req, n in zip(group, counts):
                ok = sched.kv.allocate_slots(req, n)
                assert ok, "can_swap_in promised room for the swapped blocks and the new tokens"
                req.status = RequestStatus.RUNNING
                sched.running.append(req)
                if n:
                    out.scheduled.append(ScheduledRequest(req, n, sched.kv.get_block_table(req)))
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
            counts.append(self.sched.num_new_tokens(req, budget - sum(counts)))
        return counts if counts[0] > 0 else None


def _names(group: list[Request]) -> str:
    """The group's request ids, for the log."""
    return ",".join(r.request_id for r in group)


# SchedulerLimits.preemption_mode -> the strategy the scheduler builds
PREEMPTION_MODES: dict[str, type[RecomputePreemption]] = {
    "recompute": RecomputePreemption,
    "swap": SwapPreemption,
}
