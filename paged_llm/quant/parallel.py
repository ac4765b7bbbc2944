"""Weight quantization of tensor-parallel linear layers.

Each rank quantizes its own shard after loading, as vLLM quantizes on the fly after sharding:

* a column-parallel layer (q/k/v, gate/up) holds whole output rows, so its quantized rows,
  per-row scales and int4 groups are exactly what one process computes for them;
* a row-parallel layer (o_proj, down_proj) holds a slice of every row's inputs. Its quantized
  slice multiplies the rank's input slice, the partial products are all-reduced and the bias
  is added once (:class:`RowParallelQuantLinear`). int4 groups lie inside a rank's slice when
  the group size divides it, so int4 matches one process exactly; an int8 / fp8 scale is per
  output row and per rank (the absmax of the rank's slice), so those layers round slightly
  differently from one process.

The quantized tensors are rank-local: every module here lists them in ``split_params`` so the
start-up sync of replicated parameters leaves them alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paged_llm.distributed.layers import ColumnParallelLinear, RowParallelLinear
from paged_llm.distributed.parallel_state import all_reduce

PARALLEL_LINEARS = (ColumnParallelLinear, RowParallelLinear)


class RowParallelQuantLinear(nn.Module):
    """``x [T, in/N] -> [T, out]``: this rank's quantized input columns (``quant``, no bias),
    the partial products all-reduced, then the replicated bias once."""

    def __init__(self, quant: nn.Module, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.quant = rank_local(quant)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/N] -> [T, out]
        """Quantized partial product, summed over ranks, plus the bias."""
        y = all_reduce(self.quant(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)


def rank_local(module: nn.Module) -> nn.Module:
    """Mark all of ``module``'s own parameters as split (never synced from rank 0)."""
    module.split_params = tuple(name for name, _ in module.named_parameters(recurse=False))
    return module


def quantize_parallel_linear(
    quantize_linear: Callable[[nn.Linear], nn.Module], linear: nn.Linear
) -> nn.Module:
    """The quantized replacement of a column- or row-parallel layer (see the module docstring)."""
    if isinstance(linear, RowParallelLinear):
        local = nn.Linear(linear.in_features, linear.out_features, bias=False,
                          device=linear.weight.device, dtype=linear.weight.dtype)  # fmt: skip
        local.weight = linear.weight  # the rank's [out, in/N] slice, without the bias
        return RowParallelQuantLinear(quantize_linear(local), linear.bias)
    return rank_local(quantize_linear(linear))  # rows and bias both this rank's
