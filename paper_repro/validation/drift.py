"""The machine's speed drift between calibration and each real run, and a simulated
executor that prices steps at the speed of the moment.

Measured on the shared 2-core machine: the same decode step (batch 4, context ~48, identical
shapes) took 11.5 ms in one run and 14.3 ms in another a few minutes later, on the process
clock, while other tenants' jobs came and went (they share the caches and memory bandwidth,
which CPU time does not exclude). A reference step timed just before and after each real run,
over its time at calibration, is the factor the fitted law is off by during that run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from experiments.measure_step_times import measure_mixed
from paged_llm.sim.cost_model import RooflineCostModel
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.step_law import LinearCostModel, LinearStepLaw


@dataclass
class SpeedProbe:
    """A fixed decode step (``batch`` requests of ``context`` tokens), timed on its own engine."""

    engine: Any
    clock: Callable[[], float]
    threads: Callable[[], Any]  # the runs' thread setting, as a context manager
    batch: int = 4
    context: int = 48
    steps: int = 8
    reference_s: float = 0.0  # its time at calibration

    def time(self) -> float:
        """Median seconds of the reference step now."""
        with self.threads():
            p = measure_mixed(self.engine, self.batch, self.context, 0, self.steps, self.clock)
        return p["step_time_s"]

    def drift(self, before: float, after: float) -> float:
        """The speed factor of a run between two probes (> 1: slower than at calibration)."""
        return (before + after) / 2 / self.reference_s


def scaled(law: LinearStepLaw, factor: float) -> LinearStepLaw:
    """Every coefficient times ``factor``."""
    return replace(
        law,
        fixed_s=law.fixed_s * factor,
        per_seq_s=law.per_seq_s * factor,
        per_kv_token_s=law.per_kv_token_s * factor,
        per_attn_pair_s=law.per_attn_pair_s * factor,
        per_token_s=tuple(c * factor for c in law.per_token_s),
    )


class DriftCorrectedExecutor(SimulatedExecutor):
    """The simulated executor with its fitted law scaled by ``speed`` (1: as calibrated)."""

    speed = 1.0

    def cost_model(self, block_size: int) -> RooflineCostModel:
        """The calibrated cost model at the current speed."""
        cm = super().cost_model(block_size)
        if not isinstance(cm, LinearCostModel):
            raise TypeError("drift correction scales a linear step law (calibration law: linear)")
        return replace(cm, law=scaled(cm.law, self.speed))

    @contextlib.contextmanager
    def at_speed(self, speed: float) -> Any:
        """Price the steps of the runs inside the block at ``speed``."""
        old, self.speed = self.speed, speed
        try:
            yield self
        finally:
            self.speed = old
