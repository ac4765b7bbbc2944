"""Quantization as swappable modules: weight methods (int8, int4 RTN/GPTQ/AWQ, fp8) that swap
a model's linear layers, pre-quantized GPTQ/AWQ checkpoints, and the quantized KV cache.
See docs/quantization.md."""

from __future__ import annotations

from typing import Any

# Resolved lazily: low-level ops import paged_llm.quant.kv_cache / .packing, which must not pull
# in the model loader through this package's __init__.
_EXPORTS = {
    "QUANTIZATION_METHODS": "paged_llm.quant.registry",
    "apply_quantization": "paged_llm.quant.registry",
    "build_method": "paged_llm.quant.registry",
    "load_checkpoint": "paged_llm.quant.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'paged_llm.quant' has no attribute '{name}'")


__all__ = list(_EXPORTS)
