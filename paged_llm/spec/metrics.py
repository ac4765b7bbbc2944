"""Speculative decoding counters, with vLLM's names where they exist."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_llm.spec.rejection import expected_tokens_per_step

# The source label of drafts from a drafter that does not tell them apart (a draft model).
ALL_DRAFTS = "all"


@dataclass
class SourceCounts:
    """Counts of the verifications whose drafts came from one source (e.g. one n-gram length)."""

    num_accepted_tokens: int = 0
    num_reached_tokens: int = 0  # positions judged: up to and including the first rejection
    steps_by_num_drafts: dict[int, int] = field(default_factory=dict)  # k -> verifications

    @property
    def conditional_acceptance_rate(self) -> float:
        """Acceptances over judged positions: this source's estimate of the per-token rate a."""
        reached = self.num_reached_tokens
        return self.num_accepted_tokens / reached if reached else 0.0

    def predicted_tokens(self, a: float) -> float:
        """Sum over these verifications of (1 - a^(k+1)) / (1 - a), each at its own k."""
        return sum(n * expected_tokens_per_step(a, k) for k, n in self.steps_by_num_drafts.items())

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """Count one verification."""
        self.num_accepted_tokens += num_accepted
        self.num_reached_tokens += min(num_accepted + 1, num_drafts)
        self.steps_by_num_drafts[num_drafts] = self.steps_by_num_drafts.get(num_drafts, 0) + 1


@dataclass
class SpecDecodeStats:
    """Draft and acceptance counts accumulated over an engine's life."""

    num_spec_steps: int = 0  # (sequence, step) pairs that verified drafts
    num_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    total: SourceCounts = field(default_factory=SourceCounts)
    # The same counts split by where the drafts came from (the drafter's ``draft_sources``):
    # an n-gram drafter's 4-gram matches are accepted far more often than its 1-gram ones.
    by_source: dict[str, SourceCounts] = field(default_factory=dict)

    def record(self, num_drafts: int, num_accepted: int, source: str = ALL_DRAFTS) -> None:
        """Add one verification of ``num_drafts`` drafts from ``source``, ``num_accepted`` of
        them accepted."""
        if num_drafts == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.total.add(num_drafts, num_accepted)
        self.by_source.setdefault(source, SourceCounts()).add(num_drafts, num_accepted)
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def num_accepted_tokens(self) -> int:
        """Accepted draft tokens."""
        return self.total.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def num_reached_tokens(self) -> int:
        """Draft positions the verifier actually judged (a draft after a rejection never is)."""
        return self.total.num_reached_tokens

    @property
    def steps_by_num_drafts(self) -> dict[int, int]:
        """Verifications by their number of drafts."""
        return self.total.steps_by_num_drafts

    @property
    def conditional_acceptance_rate(self) -> float:
        """Acceptances over draft positions actually reached: the estimate of the per-token rate
        a in (1 - a^(k+1)) / (1 - a). Counted per verification, so steps with fewer than k
        drafts (an n-gram drafter that found a short match, a request near its end) are weighed
        right."""
        return self.total.conditional_acceptance_rate

    @property
    def predicted_tokens_per_step(self) -> float:
        """(1 - a^(k+1)) / (1 - a) at the one measured a of all drafts, averaged over the
        verifications by their own number of drafts k (all equal to num_speculative_tokens for
        a draft model)."""
        if not self.num_spec_steps:
            return 0.0
        return self.total.predicted_tokens(self.conditional_acceptance_rate) / self.num_spec_steps

    @property
    def predicted_tokens_per_step_by_source(self) -> float:
        """The same prediction with each draft source at its own measured a: the formula assumes
        one rate for every draft, and a drafter mixing sources of different rates (n-gram
        matches of different lengths) breaks that assumption for the pooled a. Equal to
        ``predicted_tokens_per_step`` for a drafter with one source."""
        if not self.num_spec_steps:
            return 0.0
        total = sum(c.predicted_tokens(c.conditional_acceptance_rate)
                    for c in self.by_source.values())  # fmt: skip
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
            "predicted_tokens_per_step_by_source": self.predicted_tokens_per_step_by_source,
            "steps_by_num_drafts": dict(sorted(self.steps_by_num_drafts.items())),
            "sources": {
                name: {
                    "num_spec_steps": sum(c.steps_by_num_drafts.values()),
                    "conditional_acceptance_rate": c.conditional_acceptance_rate,
                }
                for name, c in sorted(self.by_source.items())
            },
            "acceptance_rate_per_position": [
                a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
        }
