"""``LoRAManager``: wraps a model's linear layers for multi-LoRA serving, keeps adapters on the
CPU (least recently used first out, ``max_cpu_loras``) and in ``max_loras`` device slots, and
maps each step's tokens to their adapter's slot before the forward pass."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from paged_llm.lora.adapter import LoRAAdapter, load_adapter
from paged_llm.lora.layers import LoRABatch, LoRALinear
from paged_llm.lora.parallel import wrap_linear
from paged_llm.lora.request import LoRARequest
from paged_llm.lora.slots import LoRASlots


def adaptable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The linear layers of the decoder blocks (attention and MLP projections), by HF module
    name: what PEFT adapters target. The blocks are what the model's ModuleLists hold
    (``model.layers``, GPT-2's ``transformer.h``); embeddings and the LM head are left alone."""
    blocks = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, nn.ModuleList))
    return {
        name: m for name, m in model.named_modules()
        if name.startswith(blocks) and hasattr(m, "in_features") and hasattr(m, "out_features")
        and not isinstance(m, LoRALinear) and not name.endswith(".base")
    }  # fmt: skip


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


class LoRAManager:
    """Adapters by ``lora_int_id``: registered, cached on the CPU, placed in device slots."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.batch = LoRABatch()
        self.slots = LoRASlots(max_loras)
        self.layers: dict[str, LoRALinear] = {}
        for name, base in adaptable_linears(model).items():
            layer = wrap_linear(base, max_loras, max_lora_rank, self.batch, dtype, device)
            _set_submodule(model, name, layer)
            self.layers[name] = layer
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear layers LoRA could adapt")
        self.modules = {n: m.full_features for n, m in self.layers.items()}
        # a model whose checkpoint fuses q/k/v says how an adapter of the fused layer splits
        # (models.weights.CheckpointWeights.lora_tensors: one to one unless a model overrides it)
        self.split = model.lora_tensors
        self.registered: dict[int, LoRARequest] = {}
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()

    # ---- adapters -----------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Register and load (checking it) an adapter; False if it was already registered (its
        weights are then read again only when a step needs them and the CPU cache dropped
        them). A ValueError names what is wrong with it; nothing changes then."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"expected a LoRARequest, got {type(request).__name__}")
        known = self.registered.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} already names adapter "
                    f"'{known.lora_name}' ({known.lora_path}); give each adapter its own id"
                )
            return False
        adapter = load_adapter(request, self.modules, self.max_lora_rank, self.split)
        self.registered[request.lora_int_id] = request
        self._keep(adapter)
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter everywhere; False if it was unknown."""
        self._cpu.pop(lora_id, None)
        self.slots.evict(lora_id)
        return self.registered.pop(lora_id, None) is not None

    def list(self) -> list[int]:
        """Ids of the registered adapters."""
        return sorted(self.registered)

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._cpu[adapter.lora_int_id] = adapter
        self._cpu.move_to_end(adapter.lora_int_id)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def _cached(self, lora_id: int) -> LoRAAdapter:
        """The adapter's CPU weights, read again from disk if the cache dropped them."""
        adapter = self._cpu.get(lora_id)
        if adapter is None:
            adapter = load_adapter(
                self.registered[lora_id], self.modules, self.max_lora_rank, self.split
            )
        self._keep(adapter)
        return adapter

    # ---- one step ---------------------------------------------------------------------------
    def activate(self, lora_ids: Sequence[int], query_lens: Sequence[int]) -> None:
        """Place this step's adapters in slots and map every token to its request's slot
        (``lora_ids`` and ``query_lens`` per request in batch order; id 0 = base model)."""
        needed = {i for i in lora_ids if i}
        if not needed:
            self.batch.set(None)
            return
        mapping, loads = self.slots.assign(needed)
        for slot, lora_id in loads:
            weights = self._cached(lora_id).weights
            for name, layer in self.layers.items():
                layer.set_slot(slot, *weights.get(name, (None, None)))
        per_token = [mapping.get(i, -1) for i, n in zip(lora_ids, query_lens) for _ in range(n)]
        self.batch.set(torch.tensor(per_token, dtype=torch.long, device=self.device))

    def deactivate(self) -> None:
        """Clear the token map after the forward pass."""
        self.batch.set(None)

    @contextlib.contextmanager
    def active(self, batch: Any) -> Iterator[None]:
        """The adapters of a runner's HostBatch active for a forward run inside the block."""
        self.activate(batch.lora_ids, batch.query_lens)
        try:
            yield
        finally:
            self.deactivate()
