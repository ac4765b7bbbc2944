"""LoRA on tensor-parallel layers (as vLLM's ColumnParallelLinearWithLoRA / RowParallel...).

An adapter is read whole and checked against the full layer; each rank keeps its part:

* column-parallel (q/k/v, gate/up): A [r, in] whole and B's rows of this rank's output slice,
  so the rank's delta is exactly its slice of the whole delta; no communication.
* row-parallel (o_proj, down_proj): A's columns of this rank's input slice and B whole; each
  rank adds its partial delta ``(x_r A_r^T) B^T`` to its partial product before the
  all-reduce, and the sum over ranks is the whole layer's output plus the whole delta.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.distributed.layers import ColumnParallelLinear, RowParallelLinear
from paged_llm.lora.layers import LoRABatch, LoRALinear


class ColumnParallelLoRALinear(LoRALinear):
    """LoRA on a column-parallel layer: B's rows of this rank's output slice."""

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, *args: object) -> None:
        super().__init__(base, *args)  # type: ignore[arg-type]
        self.full_features = base.full_features  # adapters are checked against the full layer

    def shard(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the pair (the parallel layer knows its slice)."""
        return self.base.shard_lora(a, b)


class RowParallelLoRALinear(ColumnParallelLoRALinear):
    """LoRA on a row-parallel layer: the partial delta joins the partial product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/N] -> [T, out]
        """(partial product + partial delta), summed over ranks, plus the bias once."""
        return self.base.reduce(self.add_delta(self.base.partial(x), x))


_WRAPPERS: dict[type, type[LoRALinear]] = {
    ColumnParallelLinear: ColumnParallelLoRALinear,
    RowParallelLinear: RowParallelLoRALinear,
}


def wrap_linear(
    base: nn.Module, max_loras: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype,
    device: torch.device,
) -> LoRALinear:  # fmt: skip
    """The LoRA wrapper that fits ``base``: a plain (or quantized) linear layer, or a
    tensor-parallel one, whose adapters are checked against the full layer's shape."""
    wrapper = _WRAPPERS.get(type(base), LoRALinear)
    return wrapper(
        base, base.in_features, base.out_features, max_loras, max_rank, batch, dtype, device
    )
