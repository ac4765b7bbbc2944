"""Building an ``LLMEngine``: the worker (engine/worker.py), the scheduler over its KV pool,
the request processors and the step's plug-ins, wired once. The engine's own file
(engine/llm_engine.py) then holds only what runs: vLLM's methods and the step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_llm.config import EngineConfig
from paged_llm.core.build import KVPool, build_scheduler
from paged_llm.core.scheduler import Scheduler, SchedulerLimits
from paged_llm.engine.core import EngineCore, EnginePlugin, IterationStatsLog, RunnerForward
from paged_llm.engine.generation_config import load_generation_defaults
from paged_llm.engine.input_processor import InputProcessor
from paged_llm.engine.output_processor import OutputProcessor
from paged_llm.engine.sleep_mode import SleepState
from paged_llm.engine.token_texts import TokenTexts, eos_token_id
from paged_llm.engine.worker import Worker, load_worker
from paged_llm.spec.plugin import SpecDecoding
from paged_llm.spec.registry import disable_by_batch_size
from paged_llm.utils.registry import build, target_class


def check_plugins(specs: list[Any]) -> None:
    """Import every configured plug-in (a dotted path or ``{_target_: ...}``) and refuse one
    that is no EnginePlugin, before the engine loads anything."""
    for spec in specs:
        try:
            cls = target_class("engine plug-in", spec, {})
        except (ImportError, AttributeError) as err:
            raise ValueError(f"engine plug-in {spec!r} cannot be imported: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, EnginePlugin)):
            raise ValueError(f"engine plug-in {spec!r} is not an EnginePlugin subclass")


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


def build_engine(engine: Any, config: EngineConfig, clock: Callable[[], float]) -> None:
    """Build the parts of ``engine`` (an ``LLMEngine`` being made) from ``config`` and set
    them on it, under the names vLLM users and experiments read."""
    mc = config.model
    engine.config = config
    check_plugins(config.plugins)  # a bad plug-in fails before any model loads
    # Every tensor-parallel rank that builds an engine (torchrun) runs this in lockstep;
    # ranks > 0 then serve rank 0's steps in finish_startup (distributed/launch.py).
    engine.worker = w = load_worker(config)
    engine.scheduler = engine_scheduler(w)  # before allocating: a policy's refusal fails first
    w.allocate()
    engine.parallel, engine.device, engine.model = w.parallel, w.device, w.model
    engine.hf_config, engine.runner, engine.backend = w.hf_config, w.runner, w.backend
    engine.lora, engine.pooler, engine.drafter = w.lora, w.pooler, w.drafter
    engine.kv_connector, engine.max_model_len = w.kv_connector, w.max_model_len
    engine.dtype, engine.vocab_size = w.dtype, w.vocab_size
    engine.kv_cache_tokens = w.pools.num_blocks * config.cache.block_size
    engine.text = TokenTexts(w.tokenizer)
    engine.eos_token_id = eos_token_id(w.tokenizer, w.hf_config)
    engine.generation_defaults = load_generation_defaults(
        w.model_dir, w.hf_config, mc.generation_config,
        mc.override_generation_config, engine.vocab_size,
    )  # fmt: skip
    engine.sleep_state = SleepState(enabled=mc.enable_sleep_mode)
    engine.inputs = InputProcessor(w, engine.scheduler, engine.text, engine.generation_defaults,
                                   engine.eos_token_id, engine.add_lora, clock,
                                   engine.sleep_state)  # fmt: skip
    engine.outputs = OutputProcessor(engine.scheduler, engine.text)
    engine.stats_log = IterationStatsLog(engine.scheduler, config.log_stats)
    engine.spec = SpecDecoding(w.drafter, w.runner, engine.scheduler) if w.drafter else None
    # order matters: samples fork before drafts are proposed for them
    plugins: list[EnginePlugin] = [engine.outputs, engine.stats_log]
    plugins += [engine.spec] if engine.spec is not None else []
    # configured plug-ins see the engine's parts (the core is built from the plug-ins)
    plugins += [build("engine plugin", p, {}, engine=engine) for p in config.plugins]
    forward = RunnerForward(w.runner, defer=config.scheduler.async_scheduling)
    engine.core = EngineCore(engine.scheduler, forward, plugins, clock)
    # async_output_proc / async_scheduling: the step whose outputs come next
    engine._pending = None
    sc = config.scheduler
    engine._step = engine._plain_step  # or an overlapped step (engine/async_steps.py)
    if sc.async_output_proc or sc.async_scheduling:
        engine._step = engine._pipelined_step if sc.async_scheduling else engine._overlapped_step
    if engine.parallel is not None:
        engine.parallel.finish_startup(engine.runner)  # ranks > 0 serve rank 0's steps here
