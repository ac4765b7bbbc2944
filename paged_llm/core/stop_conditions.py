"""What a request asks, beyond its token ids, to know that it is done (plain Python, no torch).

``Request.check_stop`` decides after every appended token. Length, EOS and ``stop_token_ids``
it reads from the ids; two rules need more and come from the engine, which builds one object
of each per sequence: a grammar (structured output) that hears every token and may say that
nothing can follow, and a stop condition on the output's text (stop strings). The core knows
them only by these Protocols, so it names no engine object; anything with these methods can
take their place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class OutputConstraint(Protocol):
    """A sequence's grammar state as the core sees it (engine/structured_output.GrammarGuide,
    engine/reasoning.AfterReasoning; the sampler also asks it which tokens may come next)."""

    def accept(self, token_id: int) -> None:
        """Advance past one appended output token."""

    def is_terminated(self) -> bool:
        """True once the output is complete: no token can follow."""


@runtime_checkable
class StopCondition(Protocol):
    """A stop rule on the output's text (engine/stop_strings.StopStringChecker)."""

    def __call__(self, output_token_ids: Sequence[int]) -> str | None:
        """Read the newest output token; return the stop string it completed, or None."""
