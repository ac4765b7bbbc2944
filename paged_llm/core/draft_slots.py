"""Speculative decoding's part of scheduling (plain Python, no torch): slots reserved after
each decode for the draft tokens the target verifies, and, after the step, the undoing of
rejected drafts. The scheduler builds ``DraftSlots`` only when
``SchedulerLimits.num_lookahead_slots`` is set, so a step without speculation never enters this
module (its default is ``scheduler.NoDrafts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged_llm.core.request import Request

if TYPE_CHECKING:
    from paged_llm.core.scheduler import ScheduledRequest, Scheduler


class DraftSlots:
    """Lookahead slots under ``num_lookahead_slots`` and ``spec_disable_batch_size``."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler
        self._drafting = False  # does the step being scheduled reserve draft slots?

    def begin(self) -> None:
        """Decide, before the running requests are scheduled, whether this step drafts."""
        self._drafting = self.drafts_next_step()

    def drafts_next_step(self) -> bool:
        """Whether the next schedule reserves draft slots: not while at least
        ``spec_disable_batch_size`` requests run. The running set changes only inside schedule
        and update_from_output (and by aborts), so this predicts the next step."""
        cap = self.sched.limits.spec_disable_batch_size
        return cap is None or len(self.sched.running) < cap

    def slots(self, req: Request, n: int, budget: int) -> int:
        """Draft slots for a decode: all of num_lookahead_slots if the budget and length allow."""
        if not self._drafting or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        room = req.max_total_tokens - req.num_tokens  # never draft past the request's end
        return max(0, min(self.sched.limits.num_lookahead_slots, room, budget - n))

    def update(self, s: ScheduledRequest, tokens: Sequence[int], now: float) -> None:
        """Take a request's tokens of this step (its computed count already advanced); after
        drafts, undo the rejected ones (a drafted entry is a decode, never a pooling one)."""
        req = s.request
        if not (s.num_lookahead or req.spec_token_ids):
            self.sched.take_tokens(s, tokens, now)
            return
        # Blocks of draft tokens may hold rejected KV: registered only after the truncation.
        self.sched.append_tokens(req, tokens, now)
        if req.is_finished:
            return
        # rejected drafts: their KV is invalid, so the count of computed tokens stops before
        # the newest token, and blocks past it go back to the pool
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        req.spec_token_ids = []
        self.sched.kv.truncate(req, req.num_tokens)
        self.sched.kv.on_computed(req)
