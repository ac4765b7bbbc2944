"""The model runner's calls between steps, never in one: CUDA graph capture, sleep mode
(runner/sleep.py), weight updates and LoRA adapters; ``LLMEngine.collective_rpc`` makes them on
every tensor-parallel rank. ``ModelRunner`` inherits them, so a reader of the step
(runner/model_runner.py, docs/architecture.md's reading path) need not read them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from paged_llm.runner.cuda_graphs import CudaGraphRunner
from paged_llm.runner.kv_cache import KVCaches
from paged_llm.runner.sleep import (
    HeldFreeSpace,
    RankMemory,
    Sleeper,
    SleepReport,
    device_free_bytes,
    trim_host_heap,
)
from paged_llm.spec.base import Drafter

logger = logging.getLogger("paged_llm.runner.model_runner")  # where users look for its lines
WAKE_MARGIN_BYTES = 256 * 2**20  # for the CUDA graphs captured again after waking


class RunnerControls:
    """The between-steps half of ``ModelRunner`` (it sets the attributes these read: ``model``,
    ``backend``, ``device``, ``kv_caches``...; those of its own, ``_init_controls``)."""

    def _init_controls(self, drafter: Drafter | None) -> None:
        """The state of CUDA graphs and sleep mode, none captured and awake (ModelRunner's
        construction calls it)."""
        self.cuda_graphs: CudaGraphRunner | None = None  # see capture_cuda_graphs
        # capture_cuda_graphs' arguments (sizes, max_model_len, strides, mixed tokens): wake_up
        # redoes it
        self._graph_args: tuple[list[int], int, tuple[int, ...], tuple[int, ...]] = (
            [], 0, (1,), ()
        )  # fmt: skip
        self.sleeper = Sleeper()
        # other owners of this rank's device memory (a draft model): ``device_memory()``; their
        # weights and KV sleep with the target's and their graphs are captured beside its own
        self.memory_owners: list[Drafter] = [drafter] if drafter and drafter.runs_model else []
        self.cuda_graph_error: str | None = None  # why capturing failed, if it did

    def capture_cuda_graphs(
        self,
        sizes: list[int],
        max_model_len: int,
        strides: tuple[int, ...] = (1,),
        mixed_tokens: Sequence[int] = (),
    ) -> None:
        """Capture graphs for these batch buckets and query strides (after initialize_cache;
        sizes [] = none), and for mixed steps of these token counts, this rank's and those of
        the ``memory_owners`` that run a model of their own (a draft model's; no mixed
        steps). A capture that fails leaves that model eager, with a warning: graphs only
        save time."""
        self._graph_args = (list(sizes), max_model_len, tuple(strides), tuple(mixed_tokens))
        if not sizes:
            return
        self.cuda_graphs = self._capture(
            self.model, self.kv_caches, self.kv_scales or None, sizes, max_model_len, strides,
            mixed_tokens,
        )  # fmt: skip
        for owner in self._graph_owners():
            model, caches, owner_strides = owner.graph_inputs(sizes, tuple(strides))
            owner.use_cuda_graphs(
                self._capture(model, caches, None, sizes, max_model_len, owner_strides)
            )

    def _graph_owners(self) -> list[Any]:
        """The memory owners: drafters that run a model of their own, whose graphs are
        captured beside the target's (``spec.base.Drafter.runs_model``, ``graph_inputs``)."""
        return list(self.memory_owners)

    @property
    def graph_sizes(self) -> list[int]:
        """The batch buckets ``capture_cuda_graphs`` was asked for ([] = eager)."""
        return self._graph_args[0]

    def _capture(
        self, model: Any, kv_caches: KVCaches, kv_scales: KVCaches | None, sizes: list[int],
        max_model_len: int, strides: tuple[int, ...], mixed_tokens: Sequence[int] = (),
    ) -> CudaGraphRunner | None:  # fmt: skip
        graphs = CudaGraphRunner(
            model, self.backend, kv_caches, kv_scales, sizes, self.block_size, max_model_len,
            self.device, strides, mixed_tokens,
        )  # fmt: skip
        try:
            graphs.capture()
        except Exception as err:
            self.cuda_graph_error = f"{type(err).__name__}: {err}"
            logger.warning("CUDA graph capture failed, running eagerly: %s", err, exc_info=True)
            return None
        return graphs

    # ---- sleep mode (runner/sleep.py): the same calls on every tensor-parallel rank -------------
    def device_memory(self) -> RankMemory:
        """This rank's model weights and KV pools, and those of ``memory_owners``."""
        params = [p for p in self.model.parameters()]
        lora_and_buffers = [b for b in self.model.buffers()]
        pools = [t for pair in self.kv_caches + self.kv_scales for t in pair]
        memory = RankMemory(params, lora_and_buffers, pools)
        for owner in self.memory_owners:
            extra = owner.device_memory()
            memory.other_weights += extra.parameters + extra.other_weights
            memory.kv_cache += extra.kv_cache
        return memory

    def sleep(self, level: int) -> SleepReport:
        """Free this rank's weights and KV cache (level 1 offloads the weights, level 2
        discards the parameters); CUDA graphs, which bake in their addresses, go too."""
        free_before = device_free_bytes(self.device)
        self.cuda_graphs = None  # their memory pool is freed with them
        for owner in self._graph_owners():
            owner.use_cuda_graphs(None)
        self.backend.release_buffers()
        report = self.sleeper.sleep(level, self.device_memory())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed segments back to the driver
            report.returned = device_free_bytes(self.device) - free_before
        else:
            trim_host_heap()
        return report

    def wake_up(self, tags: list[str]) -> None:
        """Restore these tags' memory; once all is awake, capture the CUDA graphs again. On
        CUDA the restored storages avoid segments that live tensors pin (``HeldFreeSpace``),
        where the driver has room for them, so the next sleep can return them."""
        needed = self.sleeper.bytes_to_restore(tags) + WAKE_MARGIN_BYTES
        room = self.device.type == "cuda" and device_free_bytes(self.device) >= needed
        held = HeldFreeSpace(self.device) if room else None
        try:
            self.sleeper.wake_up(tags)
            if not self.sleeper.asleep and self.cuda_graphs is None and self._graph_args[0]:
                self.capture_cuda_graphs(*self._graph_args)
        finally:
            if held is not None:
                held.release()

    def update_weights(self, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
        """Write HF-named tensors into this rank's model (its slices); the names written."""
        written = self.model.update_weights(weights)
        if self.kv_connector is not None:
            self.kv_connector.new_weights()  # KV saved before came from the old weights
        return written

    def apply_model(self, func: Any) -> Any:
        """``func(model)`` on this rank's model (vLLM's ``LLM.apply_model``)."""
        return func(self.model)

    def add_lora(self, lora_request: Any) -> bool:
        """Register a LoRA adapter on this rank (its part of each layer is taken when a step
        places the adapter in a slot); False if it was known."""
        return self.lora.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget a LoRA adapter on this rank; False if it was unknown."""
        return self.lora.remove(lora_id)
