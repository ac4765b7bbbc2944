"""Speculative decoding as an engine plug-in: before the forward the drafter fills each
decode's lookahead slots with drafts for the target to verify; after the update the
acceptance counts go to ``stats`` and a drafter that reads the target's hidden states (EAGLE)
observes them. The core step itself never mentions drafts (engine/core.py)."""

from __future__ import annotations

from typing import Any

from paged_llm.engine.core import EnginePlugin, StepState
from paged_llm.spec.base import Drafter
from paged_llm.spec.metrics import ALL_DRAFTS, SpecDecodeStats


class SpecDecoding(EnginePlugin):
    """Drafts before each forward, acceptance statistics after each update."""

    def __init__(self, drafter: Drafter, runner: Any, scheduler: Any) -> None:
        self.drafter, self.runner, self.scheduler = drafter, runner, scheduler
        self.stats = SpecDecodeStats()
        self._sources: dict[str, str] = {}  # request id -> its drafts' source, this step
        self._starts: dict[str, int] = {}  # request id -> computed tokens before this step

    def before_forward(self, step: StepState) -> None:
        """Move the drafter's block-shared pools with the target's, then propose drafts."""
        out = step.out
        if self.runner.block_companions:  # the drafter reads the blocks this step copies or swaps
            self.runner.apply_block_ops(out.block_ops)
            out.block_ops = []
        self._starts = {s.request.request_id: s.request.num_computed_tokens for s in out.scheduled}
        self._sources = {}
        entries = [s for s in out.scheduled if s.num_lookahead and s.samples]
        if not entries:
            return
        drafts, probs = self.drafter.propose(entries, self.runner.sampler)
        for s in entries:
            d = drafts.get(s.request.request_id, [])[: s.num_lookahead]
            if s.request.guide is not None:  # verify only what the grammar could accept
                d = d[: s.request.guide.valid_prefix(d)]
            s.request.spec_token_ids = d
            s.num_new_tokens = 1 + len(d)
        step.draft_probs = probs
        self._sources = self.drafter.draft_sources

    def after_update(self, step: StepState) -> None:
        """Count drafts and accepted tokens; hand an EAGLE head the target's features."""
        for rid, r in step.results.items():
            self.stats.record(r.num_drafts, r.num_accepted, self._sources.get(rid, ALL_DRAFTS))
        if self.runner.last_hidden is not None:
            self.drafter.observe(step.out.scheduled, self._starts, self.runner.last_hidden,
                                 will_draft=self.scheduler.drafts.drafts_next_step())  # fmt: skip

    def forget(self, request_id: str) -> None:
        """Drop the drafter's state (else a later request with this id drafts from stale KV)."""
        self.drafter.forget(request_id)
