"""Setting up a loaded model's linear layers, once (layers/linear.py has why and how they run).

``use_onednn_linears`` switches the plain CPU linears to ``OneDnnLinear`` (engine/loading.py,
right after the model is loaded). PyTorch's CPU build runs ``nn.Linear`` through MKL. On this
project's 2-core AMD EPYC (AVX-512), for the engine's models (weights streamed from memory every
step) oneDNN's matmul, which PyTorch ships as well, was faster at every input size measured:
1.01-1.24x on one thread and 1.01-1.94x on two (``python -m experiments.cpu_matmul``, table in
docs/benchmarks.md, "CPU matmuls"). For a model small enough to stay in cache (the
2.2M-parameter draft) MKL's lower per-call cost wins up to 64 rows, so the draft model keeps
torch's default. ``min_rows`` keeps inputs with fewer rows on torch's default too (engine option
``cpu_onednn_min_rows``; None: no oneDNN at all).

``merge_sibling_linears``: once the model is built, each group
a module declares in ``sibling_linears`` gets its weights laid side by side in one tensor, and
every layer's own parameters become views of its rows. The engine calls it once, last, at load
(engine/worker.py)."""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.layers.linear import MERGED_KEY, Merged, OneDnnLinear
from paged_llm.utils.cpu import native_bf16

_PLAIN = (nn.Linear, OneDnnLinear)  # the classes that merge (subclasses carry other state)


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's fused linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN's linear runs on this CPU: float32, and bfloat16 only where the CPU
    has it natively (elsewhere oneDNN has no bf16 primitive and the op raises). fp16 lacks
    kernels on most CPUs."""
    return (torch.float32, torch.bfloat16) if native_bf16() else (torch.float32,)


def use_onednn_linears(model: nn.Module, min_rows: int | None) -> int:
    """Switch every plain CPU ``nn.Linear`` of a supported dtype to ``OneDnnLinear`` (same
    parameters; ``min_rows`` None leaves the model alone); return how many were switched."""
    if min_rows is None or not onednn_available():
        return 0
    switched, dtypes = 0, onednn_dtypes()
    for module in model.modules():
        if type(module) is not nn.Linear:  # subclasses (tensor parallel, quantized) keep theirs
            continue
        if module.weight.device.type == "cpu" and module.weight.dtype in dtypes:
            # Changing the class in place keeps parameters, tied weights and names intact.
            module.__class__ = OneDnnLinear
            module.min_rows = min_rows
            switched += 1
    return switched


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
