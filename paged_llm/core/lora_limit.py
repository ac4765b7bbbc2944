"""The multi-LoRA admission limit (plain Python, no torch): at most ``max_loras`` distinct
adapters run together. A waiting group whose adapter would exceed it waits until one of them
finishes, and groups behind it whose adapters fit are admitted first (as in vLLM). The
scheduler builds a ``LoraLimit`` only when ``SchedulerLimits.max_loras`` is set, so a step
without the limit never enters this module (its default gate is ``scheduler.AnyAdapter``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from paged_llm.core.request import Request

if TYPE_CHECKING:
    from paged_llm.core.scheduler import Scheduler


class LoraLimit:
    """The scheduler's admission gate under ``max_loras``; a step's admission calls ``begin``
    once, then ``next_head`` / ``admits`` / ``admitted`` per group."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler
        self._loras: set[int] = set()  # adapters running or admitted in this step
        self._skipped: set[int] = set()  # adapters with no free slot this step

    def begin(self) -> None:
        """Start a step's admission from the adapters running now."""
        self._loras = self.running_loras()
        self._skipped = set()

    def next_head(self, waiting: Iterable[Request]) -> Request | None:
        """The first waiting request whose adapter may run; later ones keep their order."""
        return next((r for r in waiting if r.lora_int_id not in self._skipped), None)

    def admits(self, group: list[Request]) -> bool:
        """Whether the group's adapter fits beside this step's; if not, its requests wait."""
        if self.fits(group, self._loras):
            return True
        self._skipped.add(group[0].lora_int_id)
        return False

    def admitted(self, group: list[Request]) -> None:
        """Count the admitted group's adapter among this step's."""
        if group[0].lora_int_id:
            self._loras.add(group[0].lora_int_id)

    def fits_running(self, group: list[Request]) -> bool:
        """Whether the group's adapter fits beside the running requests' (a swap-in)."""
        return self.fits(group, self.running_loras())

    def running_loras(self) -> set[int]:
        """The LoRA adapters of the running requests."""
        return {r.lora_int_id for r in self.sched.running if r.lora_int_id}

    def fits(self, group: list[Request], loras: set[int]) -> bool:
        """False when the group's adapter would make more than max_loras distinct adapters."""
        lora = group[0].lora_int_id  # a group shares its prompt, hence its adapter
        if not lora or lora in loras:
            return True
        return len(loras) < self.sched.limits.max_loras
