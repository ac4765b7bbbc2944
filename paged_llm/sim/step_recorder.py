"""Record what each real engine step computed, as the simulator's StepShape."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from paged_llm.engine.core import EnginePlugin, StepState
from paged_llm.sim.cost_model import StepShape
from paged_llm.sim.executor import step_shape


class StepShapeRecorder(EnginePlugin):
    """An engine plug-in: the StepShape of every step as it will run (drafts included), read
    before the forward, while each request's computed tokens are still those before it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.shapes: list[StepShape] = []

    def before_forward(self, step: StepState) -> None:
        """Keep the step's shape."""
        self.shapes.append(step_shape(step.out, self.block_size))


@contextlib.contextmanager
def recorded_shapes(engine: Any) -> Iterator[list[StepShape]]:
    """Collect the StepShape of every step the engine takes inside the block."""
    recorder = StepShapeRecorder(engine.config.cache.block_size)
    engine.core.plugins.append(recorder)
    try:
        yield recorder.shapes
    finally:
        engine.core.plugins.remove(recorder)
