"""vLLM's LLMEngine methods that run between steps, never in one: what other code reads of the
engine's parts, LoRA adapters, weight updates, calls on every tensor-parallel rank, and sleep
mode. ``LLMEngine`` inherits them, so a
reader of the step (engine/llm_engine.py, docs/architecture.md's reading path) need not read
them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from paged_llm.distributed.launch import CallMessage, run_call
from paged_llm.engine.sleep_mode import describe
from paged_llm.lora.request import LoRARequest
from paged_llm.quant.layers import QuantLinear

logger = logging.getLogger("paged_llm.engine.llm_engine")  # where users look for its lines


class EngineControls:
    """The between-steps half of ``LLMEngine`` (it sets every attribute these read: ``lora``,
    ``parallel``, ``scheduler``, ``runner``, ``model``, ``device``, ``sleep_state``, ``core``,
    ``inputs``, ``text``, ``spec``, ``stats_log``)."""

    # ---- what other code reads of the engine's parts -----------------------------------------
    @property
    def clock(self) -> Callable[[], float]:
        """The time source that stamps arrivals, steps and tokens."""
        return self.core.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:  # experiments run on their own clocks
        self.core.clock = self.inputs.clock = clock

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None without one, or with skip_tokenizer_init)."""
        return self.text.tokenizer

    @property
    def spec_stats(self) -> Any:
        """Draft and acceptance counts (spec.metrics.SpecDecodeStats); empty without drafts."""
        if self.spec is None:
            from paged_llm.spec.metrics import SpecDecodeStats

            return SpecDecodeStats()
        return self.spec.stats

    @spec_stats.setter
    def spec_stats(self, stats: Any) -> None:
        if self.spec is not None:
            self.spec.stats = stats

    @property
    def iteration_stats(self) -> list[Any]:
        """One scheduler IterationStats per step (the newest MAX_ITERATION_STATS)."""
        return self.stats_log.stats

    @property
    def reasoning(self) -> Any:
        """The reasoning parser (``reasoning_parser``), or None."""
        return self.inputs.reasoning

    @property
    def reasoning_tags(self) -> Any:
        """The reasoning parser's tags as token ids, or None."""
        return self.inputs.reasoning_tags

    def token_text(self, token_id: int) -> str:
        """One token's own text (needs a tokenizer); decoded once per vocabulary entry, ever."""
        return self.text.token_text(token_id)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the device KV pool."""
        return self.scheduler.kv.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. between benchmark runs); False, and nothing dropped,
        while requests are running."""
        return self.scheduler.kv.reset_prefix_cache()

    def kv_usage(self) -> float:
        """Fraction of device KV blocks in use."""
        return self.scheduler.kv.usage()

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None if it has none)."""
        return self.tokenizer

    # ---- LoRA adapters (vLLM's LLMEngine methods) ---------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and load an adapter ahead of its requests; False if it was already loaded."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled; use enable_lora=True")
        added = self.lora.add(lora_request)  # checked here first: a bad adapter raises alone
        if added and self.parallel is not None:  # every rank keeps its part of each layer
            self.collective_rpc("add_lora", args=(lora_request,))
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; refused (ValueError) while requests still use it."""
        if self.lora is None:
            return False
        if any(r.lora_int_id == lora_id for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter {lora_id} is in use by unfinished requests")
        return self.collective_rpc("remove_lora", args=(lora_id,))[0]

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters."""
        return set(self.lora.list()) if self.lora is not None else set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy Hugging-Face-named tensors (a whole checkpoint or any part of it, e.g. the
        layers an RL step trained) into the model in place, between requests; the prefix
        cache, whose KV the old weights computed, is dropped. Returns the tensors written."""
        if self.has_unfinished_requests():
            raise ValueError("load_weights runs between requests; some are still running")
        if self._quantized():
            raise ValueError("load_weights needs float weights; this model is quantized")
        self.sleep_state.check_can_load()
        if self.parallel is not None:  # pickled to every rank, which keeps its own slices
            weights = [(n, t.detach().cpu()) for n, t in weights]
        written = self.collective_rpc("update_weights", args=(weights,))[0]  # checked first
        self.sleep_state.loaded(written)
        self.reset_prefix_cache()
        return len(written)

    def _quantized(self) -> bool:
        return any(isinstance(m, QuantLinear) for m in self.model.modules())

    # ---- calls on every rank, and sleep mode (vLLM's methods for RL and multi-model use) ------
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Between steps, run ``runner.<method>(*args, **kwargs)`` (a ``ModelRunner`` method)
        or ``method(runner, *args, **kwargs)`` on every tensor-parallel rank; the results in
        rank order. Under tensor parallelism the function, arguments and results are pickled."""
        if timeout is not None:
            raise ValueError("collective_rpc does not support timeout; leave it None")
        msg = CallMessage(method, tuple(args), dict(kwargs or {}))
        if self.parallel is None:
            return [run_call(self.runner, msg.method, msg.args, msg.kwargs)]
        return self.parallel.call(self.runner, msg)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """``func(model)`` on every rank's model (its slices under tensor parallelism)."""
        return self.collective_rpc("apply_model", args=(func,))

    def sleep(self, level: int = 1) -> None:
        """Between requests (with ``enable_sleep_mode=True``), free the device memory of every
        rank: the KV cache is discarded, the weights offloaded to CPU memory (level 1) or
        discarded (level 2: for load_weights to write new ones after ``wake_up``). The prefix
        cache is dropped. Requests are refused (EngineAsleepError) until ``wake_up``."""
        busy = self.has_unfinished_requests()
        self.sleep_state.check_can_sleep(level, busy, self._quantized())
        self.reset_prefix_cache()
        reports = self.collective_rpc("sleep", args=(level,))
        self.sleep_state.fell_asleep(level, (n for n, _ in self.model.named_parameters()))
        logger.info(describe(reports, self.device.type))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the memory of ``tags`` ("weights", "kv_cache"; None: both): wake the
        weights first to update them (load_weights) before the KV cache takes its memory."""
        tags = self.sleep_state.tags_to_wake(tags)
        if tags:
            self.collective_rpc("wake_up", args=(tags,))
        self.sleep_state.woke(tags)

    def is_sleeping(self) -> bool:
        """True while any of the engine's memory is asleep."""
        return bool(self.sleep_state.asleep)
