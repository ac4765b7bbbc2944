"""The engine's plug-in interface: optional features hook into fixed points of a step.

A step (engine/core.py) runs: schedule -> every plug-in's ``before_forward`` -> the forward
-> the scheduler's update -> every plug-in's ``after_update``; a plug-in's ``forget`` runs
when a sequence ends. Each hook reads and adds to the step's ``StepState``. The hooks do
nothing by default, so a plug-in overrides only the points it needs, and the core never asks
which features are on. Speculative decoding (spec/plugin.py), parallel sampling and outputs
(engine/output_processor.py) and iteration statistics (engine/stats.py) are plug-ins;
docs/architecture.md shows where each one hooks in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.scheduler import SchedulerOutput


@dataclass
class StepState:
    """One step's data as it moves through the core; plug-ins read it and add to it."""

    out: SchedulerOutput  # what the scheduler chose: requests, token counts, block moves
    # request id -> draft distributions [k, V] (speculative decoding with a draft model)
    draft_probs: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)  # request id -> SampleResult
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)  # id -> (first, entries)
    pooled: dict[str, Any] = field(default_factory=dict)  # id -> pooled output tensor
    sampled: dict[str, list[int]] = field(default_factory=dict)  # id -> tokens that joined
    now: float = 0.0  # the clock after the forward, when the update runs
    finished: list[Any] = field(default_factory=list)  # requests the update finished
    # host work to run while the device computes this step's forward (async output
    # processing: the previous step's outputs); a forward that cannot overlap leaves it
    while_running: Any = None
    # async scheduling: the sampled ids still on the device (runner.async_tokens.
    # DeferredTokens); ``sampled`` holds placeholders for them until EngineCore.resolve
    deferred: Any = None
    # time.perf_counter() at the phase boundaries: "start", "scheduled", "prepared" (plug-ins
    # before the forward done), "model" (the runner's forward returned, before sampling; set by
    # RunnerForward), "forwarded", "updating", "updated", "resolving" and "resolved" (async
    # scheduling: its tokens awaited, then on the host, in the next call), "outputs"
    # (LLMEngine made the step's outputs); engine/profile.py reads them
    marks: dict[str, float] = field(default_factory=dict)


class EnginePlugin:
    """An optional engine feature; every hook does nothing unless overridden."""

    def before_forward(self, step: StepState) -> None:
        """After scheduling, before the model runs (e.g. propose drafts, fork samples)."""

    def after_update(self, step: StepState) -> None:
        """After the scheduler took the step's tokens (e.g. record statistics)."""

    def forget(self, request_id: str) -> None:
        """A sequence finished or was aborted: drop its state."""


def check_plugins(specs: list[Any]) -> None:
    """Import every configured plug-in (a dotted path or ``{_target_: ...}``) and refuse one
    that is no EnginePlugin, before the engine loads anything."""
    from paged_llm.utils.registry import target_class

    for spec in specs:
        try:
            cls = target_class("engine plug-in", spec, {})
        except (ImportError, AttributeError) as err:
            raise ValueError(f"engine plug-in {spec!r} cannot be imported: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, EnginePlugin)):
            raise ValueError(f"engine plug-in {spec!r} is not an EnginePlugin subclass")
