"""Quantization methods by name, and the single entry point the engine calls.

``LLM(model=..., quantization="int8")``, a Hydra ``configs/quant/*.yaml`` group file
(``{_target_: paged_llm.quant.gptq.GPTQ, group_size: 128, ...}``) and plain Python all build
the same method objects from this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paged_llm.layers.moe import FusedExperts
from paged_llm.quant.base import QuantMethod
from paged_llm.quant.checkpoint import PREQUANTIZED_METHODS, prequantized_method
from paged_llm.utils.registry import build

QUANTIZATION_METHODS: dict[str, str] = {
    "int8": "paged_llm.quant.simple.Int8WeightOnly",
    "int4_rtn": "paged_llm.quant.simple.Int4RTN",
    "int4_gptq": "paged_llm.quant.gptq.GPTQ",
    "int4_awq": "paged_llm.quant.awq.AWQ",
    "fp8": "paged_llm.quant.simple.Fp8Weights",
}
NO_QUANTIZATION = (None, "none")


def method_names() -> list[str]:
    """Every accepted ``quantization=`` name."""
    return ["none", *QUANTIZATION_METHODS, *PREQUANTIZED_METHODS]


def build_method(spec: Any) -> QuantMethod | None:
    """A method object from a name, a dotted path, a ``{_target_: ...}`` mapping or an
    instance; None for no quantization."""
    if spec in NO_QUANTIZATION:
        return None
    if isinstance(spec, str) and spec not in QUANTIZATION_METHODS and "." not in spec:
        raise ValueError(f"unknown quantization method '{spec}'; choose one of {method_names()}")
    if isinstance(spec, Mapping):
        spec = dict(spec)  # Hydra DictConfig -> dict
    method = build("quantization method", spec, QUANTIZATION_METHODS)
    if not isinstance(method, QuantMethod):
        raise ValueError(
            f"quantization method {spec!r} built a {type(method).__name__}, not a QuantMethod"
        )
    return method


def checked_method(model: nn.Module, spec: Any) -> QuantMethod | None:
    """The method ``spec`` builds for ``model`` (None: leave it as it is), after refusing what
    the model cannot take. Reads shapes only, so it runs on a meta-device model too."""
    loaded = prequantized_method(model.config)
    if loaded is not None:
        if spec in (*NO_QUANTIZATION, loaded):
            return None
        raise ValueError(
            f"the checkpoint is already {loaded}-quantized; it cannot also take "
            f"quantization={spec!r} (use quantization=None or '{loaded}')"
        )
    if spec in PREQUANTIZED_METHODS:
        raise ValueError(
            f"quantization='{spec}' loads a pre-quantized {spec.upper()} checkpoint, but this one "
            f"has no quantization_config; to quantize a float model use 'int4_{spec}'"
        )
    method = build_method(spec)
    if method is None:
        return None
    if not method.supports_experts and any(isinstance(m, FusedExperts) for m in model.modules()):
        # The methods swap nn.Linear layers; stacked experts would silently stay unquantized.
        raise ValueError(
            f"quantization={spec!r} does not support mixture-of-experts models: their stacked "
            "experts have no quantized kernel for it here (int8, fp8 and int4_rtn do)"
        )
    method.check_model(model)
    return method


def apply_quantization(
    model: nn.Module,
    spec: Any,
    tokenizer: Any = None,
    calibration: torch.Tensor | None = None,
) -> nn.Module:
    """Quantize ``model``'s linear layers with method ``spec`` (None / "none": unchanged).

    GPTQ and AWQ calibrate on ``calibration`` token ids [N, L], by default on windows of the
    stdlib corpus tokenized with ``tokenizer``. For a checkpoint that is already quantized
    (config.json has a quantization_config), ``spec`` may only name its own method.
    """
    method = checked_method(model, spec)
    if method is None:
        return model
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    if method.needs_calibration and calibration is None:
        from paged_llm.quant.calibration import default_calibration

        calibration = default_calibration(
            tokenizer, model.config.vocab_size, method.num_samples, method.seq_len
        )
    model = method.quantize(model, calibration)
    for module in experts:
        method.quantize_experts(module)
    return model
