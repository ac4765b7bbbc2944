"""Where a step's wall time goes, per phase, as an engine plug-in. Add it by config:
``LLM(..., plugins=["paged_llm.engine.profile.StepPhaseProfile"])``, then read
``engine.core.plugins[-1].summary()`` (experiments write it beside their timings).

Phases, from the step's marks (engine/core.StepState):

* ``schedule``: the scheduler;
* ``plugins``: plug-ins before the forward (sample forks, drafting);
* ``inputs``: moving blocks (swaps, copies) and building the batch's device inputs (or
  loading a CUDA graph's static buffers);
* ``forward``: running the model. On a GPU the kernels are launched here (a graph replayed)
  and run on; the host first waits for them in ``sample``;
* ``sample``: sampling (or verifying drafts), until the sampled ids are on the host;
* ``update``: the scheduler takes the tokens;
* ``outputs``: the plug-ins after the update, logprobs, detokenization, stop strings and the
  RequestOutputs (LLMEngine.step; absent when another driver steps the core);
* ``caller``: from the outputs (or the update) to the next step's start: the caller's loop.

``host_ms_per_step`` sums the phases a GPU waits through (``HOST_PHASES``: all but
``forward`` and ``sample``): the host time issue 39 measures (experiments/bench_host_step.py).

With async scheduling a step's tokens reach the host in the next call of ``LLMEngine.step``,
after that call launched the next forward: ``resolve`` is the wait for them (like ``sample``,
not host work), and ``outputs`` and ``caller`` run while the device computes the next step,
so there the GPU waits only for what exceeds its own step time.

With a forward other than the runner's, ``inputs``, ``forward`` and ``sample`` are one phase,
``forward``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from paged_llm.engine.core import EnginePlugin, StepState

# (phase, from mark, to mark); a phase whose marks a step lacks is skipped for that step
PHASES = (("schedule", "start", "scheduled"), ("plugins", "scheduled", "prepared"),
          ("inputs", "prepared", "inputs"), ("forward", "inputs", "model"),
          ("sample", "model", "forwarded"),
          ("update", "updating", "updated"))  # fmt: skip
# The phases of host work a GPU waits through (sampling waits for the GPU, so it is not one)
HOST_PHASES = ("schedule", "plugins", "inputs", "update", "outputs", "caller")


class StepPhaseProfile(EnginePlugin):
    """Sums each phase's seconds over the steps it saw."""

    def __init__(self, engine: Any = None) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (e.g. after a warm-up)."""
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        # The previous step's marks (its "outputs" mark is set after its hooks), not the step:
        # a StepState can hold a closure over the engine (async outputs), and a profile kept
        # after the engine's shutdown must not keep the engine's memory alive with it.
        self._previous: dict[str, float] | None = None

    def after_update(self, step: StepState) -> None:
        """Add this step's phases, and the previous step's outputs and the caller's time."""
        m = step.marks
        if "model" not in m:  # a simulated or log-probability forward: one phase
            self.seconds["forward"] += m["forwarded"] - m["prepared"]
        for name, begin, end in PHASES:
            if begin in m and end in m:
                self.seconds[name] += m[end] - m[begin]
        before = self._previous
        if before is not None and "resolving" in before:  # async scheduling (module doc)
            resolved = before.get("resolved", before["resolving"])
            self.seconds["resolve"] += resolved - before["resolving"]
            self.seconds["outputs"] += before.get("outputs", resolved) - resolved
            self.seconds["caller"] += m["start"] - before["updated"]
        elif before is not None:
            done = before.get("outputs", before["updated"])
            self.seconds["outputs"] += done - before["updated"]
            self.seconds["caller"] += m["start"] - done
        self._previous = m
        self.steps += 1

    def summary(self) -> dict[str, Any]:
        """Per phase: total seconds, mean milliseconds per step and share of the total; and
        ``host_ms_per_step``, the mean over steps of the HOST_PHASES' sum."""
        total = sum(self.seconds.values()) or 1.0
        host = sum(self.seconds.get(name, 0.0) for name in HOST_PHASES)
        return {
            "steps": self.steps,
            "host_ms_per_step": 1e3 * host / max(self.steps, 1),
            "phases": {
                name: {
                    "seconds": s,
                    "ms_per_step": 1e3 * s / max(self.steps, 1),
                    "share": s / total,
                }  # fmt: skip
                for name, s in self.seconds.items()
            },
        }
