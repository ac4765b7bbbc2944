"""The engine's side of sleep mode (vLLM's ``enable_sleep_mode``): which memory is asleep, and
which parameters a level-2 sleep discarded that ``load_weights`` has not written again. The
memory itself is freed and restored by each rank's runner (``runner/sleep.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from paged_llm.runner.sleep import SLEEP_TAGS, SleepReport, check_level, check_tags


class EngineAsleepError(RuntimeError):
    """A request reached an engine whose memory is asleep (or whose weights are not loaded
    again after a level-2 sleep); the server answers 503."""


@dataclass
class SleepState:
    """What is asleep now; every check gives the user's next step in its message."""

    enabled: bool = False
    level: int = 0  # 0: awake
    asleep: set[str] = field(default_factory=set)  # tags whose memory is freed
    to_load: set[str] = field(default_factory=set)  # parameters discarded, not yet rewritten

    def check_can_sleep(self, level: int, busy: bool, quantized: bool) -> None:
        """Raise ValueError if the engine cannot go to sleep at ``level`` now."""
        if not self.enabled:
            raise ValueError("sleep mode is off; build the engine with enable_sleep_mode=True")
        check_level(level)
        if busy:
            raise ValueError("sleep runs between requests; some are still running")
        if self.asleep:
            raise ValueError(f"the engine is already asleep ({self._tags()}); wake_up() first")
        if level == 2 and quantized:
            raise ValueError(
                "sleep(level=2) discards the weights for load_weights to write again, and a "
                "quantized model cannot take load_weights; use level=1"
            )

    def fell_asleep(self, level: int, parameters: Iterable[str]) -> None:
        """Record a sleep at ``level`` of a model with these parameter names."""
        self.level, self.asleep = level, set(SLEEP_TAGS)
        if level == 2:
            self.to_load = set(parameters)

    def tags_to_wake(self, tags: Iterable[str] | None) -> list[str]:
        """Of these tags (None: all), those asleep, in SLEEP_TAGS order."""
        if not self.enabled:
            raise ValueError("sleep mode is off; build the engine with enable_sleep_mode=True")
        wanted = set(check_tags(tags))
        return [t for t in SLEEP_TAGS if t in wanted and t in self.asleep]

    def woke(self, tags: Iterable[str]) -> None:
        """Record that these tags' memory is back."""
        self.asleep.difference_update(tags)
        if not self.asleep:
            self.level = 0

    def check_can_load(self) -> None:
        """Raise ValueError if load_weights would write into freed memory."""
        if "weights" in self.asleep:
            raise ValueError("the weights are asleep; call wake_up(tags=['weights']) first")

    def loaded(self, names: Iterable[str]) -> None:
        """Record parameters that load_weights wrote."""
        self.to_load.difference_update(names)

    def check_awake(self) -> None:
        """Raise EngineAsleepError unless the engine can run requests."""
        if self.asleep:
            raise EngineAsleepError(
                f"the engine is asleep ({self._tags()} freed by sleep(level={self.level})); "
                "call wake_up() first"
            )
        if self.to_load:
            example = sorted(self.to_load)[0]
            raise EngineAsleepError(
                f"sleep(level=2) discarded the weights and load_weights has not written "
                f"{len(self.to_load)} of them again (e.g. '{example}'); load them first"
            )

    def _tags(self) -> str:
        return ", ".join(t for t in SLEEP_TAGS if t in self.asleep)


def describe(reports: list[SleepReport], device: str) -> str:
    """A log line of what a sleep freed on every rank."""
    gib = 2**30
    freed = sum(r.freed for r in reports) / gib
    offloaded = sum(r.offloaded for r in reports) / gib
    line = (
        f"sleep freed {freed:.3f} GiB of {device} memory on {len(reports)} rank(s); "
        f"{offloaded:.3f} GiB of it is kept in CPU memory to be restored"
    )
    returned = [r.returned for r in reports if r.returned is not None]
    if returned:  # CUDA: what other processes can now use (see runner/sleep.py)
        line += f"; the driver got {sum(returned) / gib:.3f} GiB back"
    return line
