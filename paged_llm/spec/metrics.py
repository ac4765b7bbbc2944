"""Speculative decoding counters, with vLLM's names where they exist."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_llm.spec.rejection import expected_tokens_per_step


@dataclass
class SpecDecodeStats:
    """Draft and acceptance counts accumulated over an engine's life."""

    num_spec_steps: int = 0  # (sequence, step) pairs that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # draft positions the verifier actually judged: up to and including the first rejection
    num_reached_tokens: int = 0
    steps_by_num_drafts: dict[int, int] = field(default_factory=dict)  # k -> verifications

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Add one verification of ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        if num_drafts == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_reached_tokens += min(num_accepted + 1, num_drafts)
        self.steps_by_num_drafts[num_drafts] = self.steps_by_num_drafts.get(num_drafts, 0) + 1
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def conditional_acceptance_rate(self) -> float:
        """Acceptances over draft positions actually reached (a draft after a rejection is
        never evaluated): the estimate of the per-token rate a in (1 - a^(k+1)) / (1 - a).
        Counted per verification, so steps with fewer than k drafts (an n-gram drafter that
        found a short match, a request near its end) are weighed right."""
        reached = self.num_reached_tokens
        return self.num_accepted_tokens / reached if reached else 0.0

    @property
    def predicted_tokens_per_step(self) -> float:
        """(1 - a^(k+1)) / (1 - a) at the measured a, averaged over the verifications by their
        own number of drafts k (all equal to num_speculative_tokens for a draft model)."""
        if not self.num_spec_steps:
            return 0.0
        a = self.conditional_acceptance_rate
        total = sum(n * expected_tokens_per_step(a, k) for k, n in self.steps_by_num_drafts.items())
        return total / self.num_spec_steps

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verifying step: accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    def as_dict(self) -> dict:
        """JSON-ready summary."""
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "conditional_acceptance_rate": self.conditional_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "predicted_tokens_per_step": self.predicted_tokens_per_step,
            "steps_by_num_drafts": dict(sorted(self.steps_by_num_drafts.items())),
            "acceptance_rate_per_position": [
                a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
        }
