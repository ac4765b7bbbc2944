"""Where a step's wall time goes, per phase, as an engine plug-in. Add it by config:
``LLM(..., plugins=["paged_llm.engine.profile.StepPhaseProfile"])``, then read
``engine.core.plugins[-1].summary()`` (experiments write it beside their timings).

Phases, from the core's marks (engine/core.py): ``schedule`` (the scheduler), ``plugins``
(plug-ins before the forward: sample forks, drafting), ``forward`` (input preparation, the
model, sampling; on a GPU it ends when the sampled ids reach the host), ``update`` (the
scheduler takes the tokens), ``after`` (the previous step's plug-ins after the update, its
output processing and detokenization, and the caller's own loop, up to this step's start).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from paged_llm.engine.plugins import EnginePlugin, StepState

PHASES = (("schedule", "start", "scheduled"), ("plugins", "scheduled", "prepared"),
          ("forward", "prepared", "forwarded"), ("update", "forwarded", "updated"))  # fmt: skip


class StepPhaseProfile(EnginePlugin):
    """Sums each phase's seconds over the steps it saw."""

    def __init__(self, engine: Any = None) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (e.g. after a warm-up)."""
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._last_updated: float | None = None  # the previous step's "updated" mark

    def after_update(self, step: StepState) -> None:
        """Add this step's phases, and the time between the previous step and this one."""
        m = step.marks
        for name, begin, end in PHASES:
            self.seconds[name] += m[end] - m[begin]
        if self._last_updated is not None:
            self.seconds["after"] += m["start"] - self._last_updated
        self._last_updated = m["updated"]
        self.steps += 1

    def summary(self) -> dict[str, Any]:
        """Per phase: total seconds, mean milliseconds per step and share of the total."""
        total = sum(self.seconds.values()) or 1.0
        return {
            "steps": self.steps,
            "phases": {
                name: {
                    "seconds": s,
                    "ms_per_step": 1e3 * s / max(self.steps, 1),
                    "share": s / total,
                }  # fmt: skip
                for name, s in self.seconds.items()
            },
        }
