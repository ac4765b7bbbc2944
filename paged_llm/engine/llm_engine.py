"""LLMEngine: vLLM's add_request / step / abort_request facade over the engine's parts.

Building is engine/builder.py (the worker of engine/worker.py: model, runner, optional parts,
what every tensor-parallel rank has; a scheduler; the plug-ins); a step is engine/core.py's
loop with its plug-ins; requests go in through engine/input_processor.py and come out through
engine/output_processor.py. This file keeps vLLM's methods (those for between steps in
engine/controls.py; docs/architecture.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from paged_llm.config import EngineArgs, EngineConfig
from paged_llm.engine.async_steps import AsyncStepping
from paged_llm.engine.builder import build_engine
from paged_llm.engine.controls import EngineControls
from paged_llm.lora.request import LoRARequest
from paged_llm.models.loader import resolve_dtype
from paged_llm.outputs import RequestOutput
from paged_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine(EngineControls, AsyncStepping):
    """Owns the scheduler and the model runner; each ``step()`` runs one iteration (the
    methods for between steps, LoRA, weights, sleep, are engine/controls.py's)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        build_engine(self, config, clock)  # the parts, wired once (engine/builder.py)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and leave the process group (no-op at size 1)."""
        if self.parallel is not None:
            self.parallel.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; return its id. Bad input raises and changes nothing.
        ``priority`` (with ``scheduling_policy="priority"``): smaller runs sooner;
        ``lora_request`` (with ``enable_lora``): the adapter to run it with."""
        request_id = self.inputs.request_id(request_id, self.outputs.groups)
        inputs = (request_id, prompt, params, arrival_time, priority, lora_request)
        self.outputs.add(self.inputs.make_request(*inputs))  # engine/input_processor.py
        return request_id

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort one or more requests (all their samples) and free their blocks."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._release(rid, abort=True)
        if self._pending is not None and not self.has_live_requests():
            # nothing is left to report: take the step in flight (async scheduling: wait for
            # its ids) so the engine is idle now, not one more step() later
            pending, self._pending = self._pending, None
            self.core.resolve(pending)

    def has_live_requests(self) -> bool:
        """True while a user request is unfinished or the scheduler holds a sequence."""
        return bool(self.outputs.groups) or self.scheduler.has_unfinished()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped, or its outputs are pending."""
        pending = self._pending is not None  # async_output_proc: a step's outputs still to make
        return self.has_live_requests() or pending

    def get_num_unfinished_requests(self) -> int:
        """Number of user requests not yet finished."""
        return len(self.outputs.groups)

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return outputs of requests that progressed.
        With ``async_output_proc`` the outputs are the previous step's, made while the device
        runs this step's forward (and a last call, with nothing left to run, returns them);
        with ``async_scheduling`` too, and the previous step's tokens also reach the host then
        (engine/async_steps.py; the engine chose which when it was built)."""
        return self._step()

    def _plain_step(self) -> list[RequestOutput]:
        """One step, its outputs made after it."""
        step = self.core.step()
        outputs = self._finish(step)
        step.marks["outputs"] = time.perf_counter()
        return outputs

    def _finish(self, step: Any) -> list[RequestOutput]:
        """The outputs of a step that ran; finished requests are released."""
        outputs = self.outputs.outputs(step)
        for output in outputs:
            if output.finished:
                self._release(output.request_id)
        return outputs

    def _release(self, request_id: str, abort: bool = False) -> None:
        """Stop tracking a user request (aborting its sequences in the scheduler first) and drop
        each sequence's state in the runner and the plug-ins."""
        group = self.outputs.pop(request_id)
        for t in group.members if group is not None else []:
            seq_id = t.request.request_id
            if abort:
                self.scheduler.abort_request(seq_id)
            self.runner.forget(seq_id)
            self.core.forget(seq_id)

    def iter_outputs(self) -> Iterator[RequestOutput]:
        """Step until every request finishes, yielding each step's outputs (streaming)."""
        while self.has_unfinished_requests():
            yield from self.step()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, **kwargs: Any) -> LLMEngine:
        """Build from vLLM's ``EngineArgs`` or from the same keyword arguments."""
        if engine_args is None:
            engine_args = EngineArgs(**kwargs)
        elif kwargs:
            raise ValueError("pass EngineArgs or keyword arguments, not both")
        return cls(engine_args.create_engine_config())


__all__ = ["LLMEngine", "resolve_dtype"]
