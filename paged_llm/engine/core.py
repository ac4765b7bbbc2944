"""The engine's step: the one loop every executor shares.

    schedule -> plug-ins before the forward -> forward -> scheduler update -> plug-ins after

With async scheduling (engine/llm_engine.py) a forward may leave its sampled ids on the
device: the update then records placeholders, and ``resolve`` a step later writes the tokens
in and calls the plug-ins after it (docs/architecture.md).

``EngineCore`` knows nothing of optional features: they are plug-ins (engine/plugins.py). What
the forward is is swappable too: the real model runner sampling tokens (``RunnerForward``), the
runner returning log-probabilities for beam search to choose from (``LogprobsForward``), or a
simulated step time (sim/executor.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from paged_llm.core.request import PLACEHOLDER_TOKEN
from paged_llm.core.scheduler import Scheduler
from paged_llm.engine.plugins import EnginePlugin, StepState

Forward = Callable[[StepState], None]  # runs the model on step.out, fills step.sampled


class RunnerForward:
    """The model runner's forward: sample (or verify drafts) for every scheduled request."""

    def __init__(self, runner: Any, defer: bool = False) -> None:
        self.runner = runner
        self.defer = defer  # async scheduling: leave plain sampled ids on the device

    def __call__(self, step: StepState) -> None:
        """Run the step; the sampled tokens (placeholders for those left on the device),
        prompt logprobs and pooled outputs into ``step``."""
        step.results, step.prompt_logprobs, step.pooled, step.deferred = self.runner.execute(
            step.out, step.draft_probs, while_running=step.while_running, defer=self.defer
        )
        # inputs loaded, then the forward returned; then sampling
        step.marks.update(inputs=self.runner.inputs_done, model=self.runner.model_done)
        step.sampled = {rid: r.token_ids for rid, r in step.results.items()}
        if step.deferred is not None:
            step.sampled.update((r.request_id, [PLACEHOLDER_TOKEN]) for r in step.deferred.requests)


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
        step = self.launch(forward, while_running)
        self.update(step)
        self.resolve(step)
        return step

    def launch(self, forward: Forward | None = None, while_running: Any = None) -> StepState:
        """Schedule, let the plug-ins prepare, run the forward (with async scheduling its
        sampled ids may still be on the device when it returns)."""
        start = time.perf_counter()
        step = StepState(self.scheduler.schedule(self.clock()), while_running=while_running)
        step.marks.update(start=start, scheduled=time.perf_counter())
        for plugin in self.plugins:
            plugin.before_forward(step)
        step.marks["prepared"] = time.perf_counter()
        (forward or self.forward)(step)
        step.marks["forwarded"] = time.perf_counter()
        return step

    def update(self, step: StepState) -> None:
        """The scheduler takes the step's tokens (placeholders for those still on the
        device); the plug-ins see the step now if its tokens are all known."""
        step.marks["updating"] = time.perf_counter()  # async scheduling: a call after "forwarded"
        step.now = self.clock()
        step.finished = self.scheduler.update_from_output(step.out, step.sampled, step.now)
        step.marks["updated"] = time.perf_counter()
        if step.deferred is None:
            self._after_update(step)

    def resolve(self, step: StepState) -> None:
        """Async scheduling: write the tokens a step left on the device over its placeholders
        (the next step already launched), finish the requests they stop, then call the
        plug-ins; nothing to do for a step whose tokens were known."""
        deferred, step.deferred = step.deferred, None
        if deferred is None:
            return
        chosen, step.results = deferred.collect()  # waits for that step's copy only
        step.prompt_logprobs = deferred.prompt_logprobs()  # copied with the ids
        step.now = self.clock()
        step.marks["resolved"] = time.perf_counter()
        step.sampled = {r.request_id: [t] for r, t in chosen}
        step.finished = step.finished + self.scheduler.resolve_placeholders(chosen, step.now)
        self._after_update(step)

    def _after_update(self, step: StepState) -> None:
        for plugin in self.plugins:
            plugin.after_update(step)

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted sequence's state in every plug-in."""
        for plugin in self.plugins:
            plugin.forget(request_id)
