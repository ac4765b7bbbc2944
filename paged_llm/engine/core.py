"""The engine's step: the one loop every executor shares.

    schedule -> plug-ins before the forward -> forward -> scheduler update -> plug-ins after

``EngineCore`` knows nothing of optional features: they are plug-ins (engine/plugins.py). What
the forward is is swappable too: the real model runner sampling tokens (``RunnerForward``), the
runner returning log-probabilities for beam search to choose from (``LogprobsForward``), or a
simulated step time (sim/executor.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from paged_llm.core.scheduler import Scheduler
from paged_llm.engine.plugins import EnginePlugin, StepState

Forward = Callable[[StepState], None]  # runs the model on step.out, fills step.sampled


class RunnerForward:
    """The model runner's forward: sample (or verify drafts) for every scheduled request."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def __call__(self, step: StepState) -> None:
        """Run the step; the sampled tokens, prompt logprobs and pooled outputs into ``step``."""
        step.results, step.prompt_logprobs, step.pooled = self.runner.execute(
            step.out, step.draft_probs, while_running=step.while_running
        )
        # inputs loaded, then the forward returned; then sampling
        step.marks.update(inputs=self.runner.inputs_done, model=self.runner.model_done)
        step.sampled = {rid: r.token_ids for rid, r in step.results.items()}


class LogprobsForward:
    """The runner's forward without sampling: each due request's next-token log-probabilities
    [V] go to ``rows``, and the caller (beam search) appends tokens itself."""

    def __init__(self, runner: Any, rows: dict[str, Any]) -> None:
        self.runner, self.rows = runner, rows

    def __call__(self, step: StepState) -> None:
        """Run the step; no token joins any sequence here."""
        self.rows.update(self.runner.execute_logprobs(step.out))


class EngineCore:
    """A scheduler, a forward and the plug-ins, stepped together."""

    def __init__(
        self,
        scheduler: Scheduler,
        forward: Forward,
        plugins: list[EnginePlugin],
        clock: Callable[[], float],
    ) -> None:
        self.scheduler = scheduler
        self.forward = forward
        self.plugins = plugins  # called in order; see engine/plugins.py
        self.clock = clock

    def step(self, forward: Forward | None = None, while_running: Any = None) -> StepState:
        """One iteration; ``forward`` replaces the core's own for this step (beam search);
        ``while_running()``: host work the runner does while the device runs the forward."""
        start = time.perf_counter()
        step = StepState(self.scheduler.schedule(self.clock()), while_running=while_running)
        step.marks.update(start=start, scheduled=time.perf_counter())
        for plugin in self.plugins:
            plugin.before_forward(step)
        step.marks["prepared"] = time.perf_counter()
        (forward or self.forward)(step)
        step.marks["forwarded"] = time.perf_counter()
        step.now = self.clock()
        step.finished = self.scheduler.update_from_output(step.out, step.sampled, step.now)
        step.marks["updated"] = time.perf_counter()
        for plugin in self.plugins:
            plugin.after_update(step)
        return step

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted sequence's state in every plug-in."""
        for plugin in self.plugins:
            plugin.forget(request_id)
