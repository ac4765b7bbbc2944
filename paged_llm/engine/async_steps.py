"""``LLMEngine.step`` with the host's work overlapped with the device's: ``async_output_proc``
(a step's outputs are made while the device runs the next step's forward) and
``async_scheduling`` (step N + 1 is planned and launched before step N's tokens reach the
host). ``LLMEngine`` inherits these and picks its step once, when it is built, so a plain
step (docs/architecture.md's reading path) enters none of them."""

from __future__ import annotations

import time

from paged_llm.outputs import RequestOutput


class AsyncStepping:
    """The overlapped steps of ``LLMEngine`` (it sets what these read: ``core``,
    ``scheduler``, ``_pending``, ``_finish``)."""

    def _overlapped_step(self) -> list[RequestOutput]:
        """Async output processing: run this step's forward while making the previous
        step's outputs, and return those (a last call, with nothing left to run, returns
        them)."""
        pending, self._pending = self._pending, None
        if not self.scheduler.has_unfinished():
            return self._finish(pending) if pending is not None else []
        made: list[list[RequestOutput]] = []  # the previous step's outputs, made once
        make = (lambda: made.append(self._finish(pending))) if pending is not None else None
        self._pending = self.core.step(while_running=make)
        if pending is not None and not made:  # the forward ran nothing, so did not call it
            make()
        return made[0] if made else []

    def _pipelined_step(self) -> list[RequestOutput]:
        """Async scheduling: plan and launch step N + 1 (step N's tokens are placeholders),
        then, while the device runs it, take step N's tokens, stops and outputs; last, N + 1
        is recorded with placeholders for the tokens it left on the device."""
        previous, self._pending = self._pending, None
        step = self.core.launch() if self.scheduler.has_unfinished() else None
        outputs: list[RequestOutput] = []
        if previous is not None:
            previous.marks["resolving"] = time.perf_counter()
            self.core.resolve(previous)
            outputs = self._finish(previous)
            previous.marks["outputs"] = time.perf_counter()
        if step is not None:
            self.core.update(step)
            # a step that ran nothing (its requests' last tokens were pending) has no outputs
            self._pending = step if step.out.scheduled else None
        return outputs
