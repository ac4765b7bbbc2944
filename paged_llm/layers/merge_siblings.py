"""Merging sibling linear layers (layers/merged_linear.py has why and how a merged group
runs): once the model is built, each group a module declares in ``sibling_linears`` gets its
weights laid side by side in one tensor, and every layer's own parameters become views of its
rows. The engine calls this once, last, at load (engine/worker.py)."""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.layers.cpu_linear import OneDnnLinear
from paged_llm.layers.merged_linear import MERGED_KEY, Merged

_PLAIN = (nn.Linear, OneDnnLinear)  # the classes that merge (subclasses carry other state)


def merge_sibling_linears(model: nn.Module) -> int:
    """Merge every group a module of ``model`` declares in ``sibling_linears`` whose layers are
    plain linears of one class, device and dtype, biased alike; return how many merged."""
    merged = 0
    for owner in model.modules():
        for names in getattr(type(owner), "sibling_linears", ()):
            merged += _merge(owner, tuple(names))
    return merged


def _mergeable(layers: list[nn.Module]) -> bool:
    first = layers[0]
    if type(first) not in _PLAIN:
        return False
    return all(
        type(layer) is type(first)
        and layer.in_features == first.in_features
        and layer.weight.dtype == first.weight.dtype
        and layer.weight.device == first.weight.device
        and (layer.bias is None) == (first.bias is None)
        and vars(layer).get("min_rows") == vars(first).get("min_rows")
        for layer in layers
    )


def _merge(owner: nn.Module, names: tuple[str, ...]) -> bool:
    if names in owner.__dict__.get(MERGED_KEY, {}):
        return False  # merged already
    layers = [getattr(owner, name) for name in names]
    if not _mergeable(layers):
        return False
    first = layers[0]
    sizes = [layer.out_features for layer in layers]
    with torch.no_grad():
        weight = torch.cat([layer.weight for layer in layers])  # [sum N, K]
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
    merged = type(first)(first.in_features, sum(sizes), bias=bias is not None, device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    merged.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    if "min_rows" in vars(first):  # OneDnnLinear's per-layer switch
        merged.min_rows = first.min_rows
    start = 0
    for layer, size in zip(layers, sizes):
        rows = slice(start, start + size)
        layer.weight = nn.Parameter(weight[rows], requires_grad=layer.weight.requires_grad)
        if bias is not None:
            layer.bias = nn.Parameter(bias[rows], requires_grad=layer.bias.requires_grad)
        start += size
    owner.__dict__.setdefault(MERGED_KEY, {})[names] = Merged(merged, sizes, layers)
    return True
