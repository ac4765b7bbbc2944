"""``kv_budget_of``: size a real engine's KV pool to what another GPU would hold for the same
model, so a larger GPU (an H200) runs in the memory-bound regime of the paper's A100-40GB.

The budget is the roofline's memory plan (``RooflineCostModel.num_kv_blocks``): the GPU's memory
times ``gpu_memory_utilization``, less the model's weights and a full step's activations,
divided by a block's K/V bytes. For OPT-13B on an A100-40GB at the artifact's settings it gives
967 blocks of 16 tokens; the artifact's profiler found 983 (Table 1: 15.7K slots). Plain Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from paged_llm.sim.cost_model import RooflineCostModel
from paged_llm.sim.hardware import get_hardware
from paged_llm.sim.model_shapes import from_hf_config
from paged_llm.sim.settings import ServingSettings


@dataclass(frozen=True)
class KVBudget:
    """The KV pool another GPU would hold: the blocks and how they were worked out."""

    gpu: str
    model: str
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    weight_bytes: int
    activation_bytes: float
    gpu_memory_utilization: float

    @property
    def num_slots(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for result files."""
        return {**asdict(self), "num_slots": self.num_slots}


def kv_budget(
    gpu: str | dict[str, Any], hf_config: Any, settings: ServingSettings, model: str,
    dtype_bytes: int = 2,
) -> KVBudget:  # fmt: skip
    """The KV pool ``gpu`` (a preset name, or ``{name: ..., field: override}``) holds for the
    model of ``hf_config`` in ``dtype_bytes``-byte weights and KV, at these engine settings."""
    spec = dict(gpu) if isinstance(gpu, dict) else {"name": gpu}
    hardware = get_hardware(spec.pop("name"), **spec)
    shape = from_hf_config(hf_config, model, dtype_bytes=dtype_bytes)
    cm = RooflineCostModel(hardware, shape, block_size=settings.block_size)
    act = cm.activation_bytes(settings.max_num_batched_tokens, settings.max_num_seqs)
    blocks = cm.num_kv_blocks(settings.gpu_memory_utilization, act)
    return KVBudget(
        hardware.name, model, blocks, settings.block_size, shape.kv_bytes_per_token,
        shape.weight_bytes, act, settings.gpu_memory_utilization,
    )  # fmt: skip
