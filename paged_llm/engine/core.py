"""The engine's step: the one loop every executor shares.

    schedule -> plug-ins before the forward -> forward -> scheduler update -> plug-ins after

With async scheduling (engine/llm_engine.py) a forward may leave its sampled ids on the
device: the update then records placeholders, and ``resolve`` a step later writes the tokens
in and calls the plug-ins after it (docs/architecture.md).

``EngineCore`` knows nothing of optional features: they are plug-ins (``EnginePlugin``, below),
which hook into fixed points of a step. Each hook reads and adds to the step's ``StepState``;
the hooks do nothing by default, so a plug-in overrides only the points it needs, and the core
never asks which features are on. Speculative decoding (spec/plugin.py), parallel sampling and
outputs (engine/output_processor.py) and iteration statistics (``IterationStatsLog``, below)
are plug-ins; docs/architecture.md shows where each one hooks in. What the forward is is
swappable too: the real model runner sampling tokens (``RunnerForward``), the runner returning
log-probabilities for beam search to choose from (``LogprobsForward``), or a simulated step
time (sim/executor.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.request import PLACEHOLDER_TOKEN
from paged_llm.core.scheduler import Scheduler, SchedulerOutput

# IterationStatsLog's (the statistics plug-in, at the end of this file):
logger = logging.getLogger("paged_llm.engine.llm_engine")  # where users look for the line
MAX_ITERATION_STATS = 100_000  # ~a few hours of steps; experiments read far fewer
LOG_EVERY_S = 5.0


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
        self.plugins = plugins  # called in order; see EnginePlugin
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


class IterationStatsLog(EnginePlugin):
    """Keeps every step's statistics (the oldest half dropped past MAX_ITERATION_STATS, so a
    long-lived engine does not grow without bound); logs a status line every 5 s if asked."""

    def __init__(self, scheduler: Any, log_stats: bool) -> None:
        self.scheduler, self.log_stats = scheduler, log_stats
        self.stats: list[Any] = []
        self._last_log = float("-inf")

    def after_update(self, step: StepState) -> None:
        """Record the step's statistics."""
        stats = step.out.stats
        if stats is None:
            return
        if len(self.stats) >= MAX_ITERATION_STATS:
            del self.stats[: MAX_ITERATION_STATS // 2]
        self.stats.append(stats)
        if self.log_stats and step.now - self._last_log >= LOG_EVERY_S:
            self._last_log = step.now
            logger.info(
                "Running: %d reqs, Swapped: %d reqs, Pending: %d reqs, KV cache usage: %.1f%%, "
                "batched tokens: %d, preemptions so far: %d",
                stats.num_running, stats.num_swapped, stats.num_waiting, 100 * stats.kv_usage,
                stats.num_batched_tokens, self.scheduler.num_preemptions_total,
            )  # fmt: skip
