"""Iteration statistics as an engine plug-in: one IterationStats per step for experiments,
and vLLM's periodic status line with ``log_stats=True``."""

from __future__ import annotations

import logging
from typing import Any

from paged_llm.engine.plugins import EnginePlugin, StepState

logger = logging.getLogger("paged_llm.engine.llm_engine")  # where users look for the line
MAX_ITERATION_STATS = 100_000  # ~a few hours of steps; experiments read far fewer
LOG_EVERY_S = 5.0


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
