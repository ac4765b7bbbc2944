"""Refuse a quantization method a model cannot take before any weights load or are written:
the checks run on a meta-device copy of the model (shapes only, no memory)."""

from __future__ import annotations

from typing import Any

from paged_llm.quant.registry import checked_method


def check_quantization(spec: Any, hf_config: Any) -> None:
    """Raise a clear ValueError when a model of ``hf_config`` cannot take quantization ``spec``."""
    from paged_llm.models.presets import build_random_model

    if not spec:
        return
    model, _ = build_random_model(hf_config, device="meta")
    try:
        checked_method(model, spec)
    except ValueError as err:
        arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
        raise ValueError(f"the quant method cannot quantize this {arch}: {err}") from None
