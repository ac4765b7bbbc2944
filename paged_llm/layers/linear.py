"""The linear layers a forward runs beyond ``nn.Linear``: ``OneDnnLinear`` (oneDNN's matmul on
the CPU; why and where it is switched on: layers/linear_setup.py) and sibling layers (q/k/v,
gate/up) computed as one GEMM.

Siblings read the same input. Run one by one, each costs a launch, and at decode batch sizes
the small ones run well below the memory bandwidth: in the H200's decode graph steps (run 11,
LLaMA-7B shape at batch 64, ``paper_repro/gpu_results/2026-12-04-h200-run11-e2e-profile_steps.txt``)
q/k/v/o's 33.5 MB GEMMs took 12.2 us each (2.75 TB/s), gate/up's 90 MB ones 25.7 us (3.5 TB/s).

A module names its groups in ``sibling_linears``. After the model is built (quantized,
LoRA-wrapped, sharded), ``merge_sibling_linears`` (layers/linear_setup.py, once at load)
lays each group's weights side by side
in one tensor and makes every layer's own parameters views of its rows. Checkpoint names,
``load_weights`` (an in-place copy), sleep mode (storages, shared ones once) and everything else
that reads a layer's parameters see no change. The forward asks :func:`sibling_outputs`: one GEMM
and a split for a merged group, each layer in turn otherwise. Quantized, LoRA-wrapped and
tensor-parallel layers (not plain ``nn.Linear``) are left apart.

The merged layer is kept out of the module tree (no second copy of the parameters in
``state_dict`` or ``parameters()``). A layer replaced after merging (wrapped, quantized) sends
its group back to one GEMM per layer, but a sibling's parameter replaced, or the model converted
(``.to``, ``.half``), would leave the merged weights stale: the engine merges last, right before
sizing the KV cache, and nothing converts its model afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` whose inference forward on inputs of >= ``min_rows`` rows calls oneDNN."""

    min_rows: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        """``x @ W.T + b``; oneDNN for large inputs, torch's default otherwise (and for
        autograd, which oneDNN's op does not support)."""
        rows = x.numel() // max(1, x.shape[-1])
        if rows < self.min_rows or (
            torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        ):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


MERGED_KEY = "_merged_linears"  # owner.__dict__ entry: names -> Merged


@dataclass(frozen=True)
class Merged:
    """One merged group: the GEMM of its layers and how its output splits."""

    linear: nn.Linear  # [sum N, K] weights; outside the module tree
    sizes: list[int]  # each layer's N
    layers: list[nn.Module]  # the layers merged, to notice one replaced since


def sibling_outputs(
    owner: nn.Module, names: tuple[str, ...], x: torch.Tensor
) -> list[torch.Tensor]:
    """``[owner.<name>(x) for name in names]``: one GEMM (outputs are column views of its
    [..., sum N] result) once the group is merged and none of its layers was replaced since."""
    merged = owner.__dict__.get(MERGED_KEY, {}).get(names)
    layers = [getattr(owner, name) for name in names]
    if merged is None or any(a is not b for a, b in zip(layers, merged.layers)):
        return [layer(x) for layer in layers]  # e.g. a layer wrapped or quantized afterwards
    return list(merged.linear(x).split(merged.sizes, dim=-1))


def merged_groups(owner: nn.Module) -> list[tuple[str, ...]]:
    """The groups of ``owner`` that run as one GEMM."""
    return list(owner.__dict__.get(MERGED_KEY, {}))
