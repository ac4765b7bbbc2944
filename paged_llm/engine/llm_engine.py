"""LLMEngine: vLLM's add_request / step / abort_request facade over the engine's parts.

Building is engine/worker.py (model, runner, optional parts; what every tensor-parallel rank
has) plus a scheduler; a step is engine/core.py's loop with its plug-ins; requests go in
through engine/input_processor.py and come out through engine/output_processor.py. This file
only wires them together and keeps vLLM's methods (those for between steps in
engine/controls.py; docs/architecture.md).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from paged_llm.config import EngineArgs, EngineConfig
from paged_llm.core.build import KVPool, build_scheduler
from paged_llm.core.scheduler import Scheduler, SchedulerLimits
from paged_llm.engine.async_steps import AsyncStepping
from paged_llm.engine.controls import EngineControls
from paged_llm.engine.core import EngineCore, RunnerForward
from paged_llm.engine.generation_config import load_generation_defaults
from paged_llm.engine.input_processor import InputProcessor
from paged_llm.engine.output_processor import OutputProcessor
from paged_llm.engine.plugins import EnginePlugin, check_plugins
from paged_llm.engine.request_group import RequestGroup
from paged_llm.engine.sleep_mode import SleepState
from paged_llm.engine.stats import IterationStatsLog
from paged_llm.engine.token_texts import TokenTexts, eos_token_id
from paged_llm.engine.worker import Worker, load_worker
from paged_llm.lora.request import LoRARequest
from paged_llm.models.loader import resolve_dtype
from paged_llm.outputs import RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.spec.plugin import SpecDecoding
from paged_llm.spec.registry import disable_by_batch_size
from paged_llm.utils.registry import build

logger = logging.getLogger(__name__)


def engine_scheduler(worker: Worker) -> Scheduler:
    """The scheduler over the worker's KV pool, under the config's batch limits."""
    config, p = worker.config, worker.pools
    cc, sc = config.cache, config.scheduler
    pool = KVPool(
        p.num_blocks, cc.block_size, worker.max_model_len, p.num_cpu_blocks,
        p.num_offload_blocks, cc.enable_prefix_caching, worker.sliding_window,
        worker.kv_connector,
    )  # fmt: skip
    limits = SchedulerLimits(
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.token_budget(worker.max_model_len),
        enable_chunked_prefill=sc.enable_chunked_prefill,
        preemption_mode=sc.preemption_mode,
        num_lookahead_slots=worker.drafter.k if worker.drafter is not None else 0,
        spec_disable_batch_size=disable_by_batch_size(config.speculative_config),
        scheduling_policy=sc.scheduling_policy,
        max_loras=config.lora.max_loras if worker.lora is not None else 0,
    )
    return build_scheduler(sc.policy, pool, limits)


class LLMEngine(EngineControls, AsyncStepping):
    """Owns the scheduler and the model runner; each ``step()`` runs one iteration (the
    methods for between steps, LoRA, weights, sleep, are engine/controls.py's)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        mc = config.model
        check_plugins(config.plugins)  # a bad plug-in fails before any model loads
        # Every tensor-parallel rank that builds an engine (torchrun) runs this in lockstep;
        # ranks > 0 then serve rank 0's steps in finish_startup (distributed/launch.py).
        self.worker = w = load_worker(config)
        self.scheduler = engine_scheduler(w)  # before allocating: a policy's refusal fails first
        w.allocate()
        # the worker's parts, under the names vLLM users and experiments read
        self.parallel, self.device, self.model = w.parallel, w.device, w.model
        self.hf_config, self.runner, self.backend = w.hf_config, w.runner, w.backend
        self.lora, self.pooler, self.drafter = w.lora, w.pooler, w.drafter
        self.kv_connector, self.max_model_len = w.kv_connector, w.max_model_len
        self.dtype, self.vocab_size = w.dtype, w.vocab_size
        self.kv_cache_tokens = w.pools.num_blocks * config.cache.block_size
        self.text = TokenTexts(w.tokenizer)
        self.eos_token_id = eos_token_id(w.tokenizer, w.hf_config)
        self.generation_defaults = load_generation_defaults(
            w.model_dir, w.hf_config, mc.generation_config,
            mc.override_generation_config, self.vocab_size,
        )  # fmt: skip
        self.sleep_state = SleepState(enabled=mc.enable_sleep_mode)
        self.inputs = InputProcessor(w, self.scheduler, self.text, self.generation_defaults,
                                     self.eos_token_id, self.add_lora, clock)  # fmt: skip
        self.outputs = OutputProcessor(self.scheduler, self.text)
        self.stats_log = IterationStatsLog(self.scheduler, config.log_stats)
        self.spec = SpecDecoding(w.drafter, w.runner, self.scheduler) if w.drafter else None
        # order matters: samples fork before drafts are proposed for them
        plugins: list[EnginePlugin] = [self.outputs, self.stats_log]
        plugins += [self.spec] if self.spec is not None else []
        # configured plug-ins see the engine's parts (the core is built from the plug-ins)
        plugins += [build("engine plugin", p, {}, engine=self) for p in config.plugins]
        forward = RunnerForward(w.runner, defer=config.scheduler.async_scheduling)
        self.core = EngineCore(self.scheduler, forward, plugins, clock)
        self._counter = itertools.count()
        # async_output_proc / async_scheduling: the step whose outputs come next
        self._pending: Any = None
        sc = config.scheduler
        self._step = self._plain_step  # or an overlapped step (engine/async_steps.py)
        if sc.async_output_proc or sc.async_scheduling:
            self._step = self._pipelined_step if sc.async_scheduling else self._overlapped_step
        if self.parallel is not None:
            self.parallel.finish_startup(self.runner)  # ranks > 0 serve rank 0's steps here

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and leave the process group (no-op at size 1)."""
        if self.parallel is not None:
            self.parallel.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestGroup:
        """Validate a prompt and its parameters; raise ValueError before any work is done
        (EngineAsleepError while sleep mode has the engine's memory)."""
        self.sleep_state.check_awake()
        return self.inputs.make_request(
            request_id, prompt, params, arrival_time, priority, lora_request
        )

    def enqueue(self, group: RequestGroup) -> None:
        """Queue a group that ``make_request`` validated."""
        self.outputs.add(group)

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
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self.outputs.groups:
            raise ValueError(f"request id '{request_id}' is already in use")
        group = self.make_request(request_id, prompt, params, arrival_time, priority, lora_request)
        self.enqueue(group)
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
