"""Record what each real engine step computed, as the simulator's StepShape."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from paged_llm.sim.cost_model import StepShape
from paged_llm.sim.executor import step_shape


@contextlib.contextmanager
def recorded_shapes(engine: Any) -> Iterator[list[StepShape]]:
    """Collect the StepShape of every step the engine takes inside the block. The engine does
    not return its SchedulerOutput, so the scheduler instance's ``schedule`` is wrapped for the
    duration: what is recorded is exactly what each step computed."""
    sched = engine.scheduler
    block_size = engine.config.cache.block_size
    schedule = sched.schedule
    shapes: list[StepShape] = []

    def recording(now: float = 0.0) -> Any:
        out = schedule(now)
        shapes.append(step_shape(out, block_size))
        return out

    sched.schedule = recording
    try:
        yield shapes
    finally:
        del sched.schedule  # the class's method again
