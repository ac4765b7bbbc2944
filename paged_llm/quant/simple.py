"""Methods that need no calibration data: int8 and fp8 per channel, int4 round-to-nearest."""

from __future__ import annotations

import logging

import torch
from torch import nn

from paged_llm.quant.base import Int4GroupCheck, PerLayerMethod
from paged_llm.quant.experts import (
    quantize_experts_fp8,
    quantize_experts_int4,
    quantize_experts_int8,
)
from paged_llm.quant.int4 import rtn_quantize
from paged_llm.quant.layers import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    check_int4_shape,
    fp8_matmul_supported,
)

logger = logging.getLogger(__name__)


class Int8WeightOnly(PerLayerMethod):
    """int8 weights, symmetric, one scale per output channel; activations stay in float."""

    name = "int8"
    supports_experts = True

    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        """Absmax int8 of each output row."""
        return Int8Linear.from_float(linear)

    def quantize_experts(self, experts: nn.Module) -> None:
        """The same per output channel of every expert (quant/experts.py)."""
        quantize_experts_int8(experts)


class Int4RTN(Int4GroupCheck, PerLayerMethod):
    """int4 group-wise asymmetric, round-to-nearest (the baseline GPTQ and AWQ improve on)."""

    name = "int4_rtn"
    supports_experts = True

    def __init__(self, group_size: int = 128) -> None:
        self.group_size = group_size

    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        """Min-max scale and zero per group, then round."""
        check_int4_shape(linear.in_features, linear.out_features, self.group_size)
        q, scales, zeros = rtn_quantize(linear.weight.detach(), self.group_size)
        return Int4Linear.from_quantized(q, scales, zeros, self.group_size, linear.bias)

    def quantize_experts(self, experts: nn.Module) -> None:
        """The same per output channel and group of every expert (quant/experts.py)."""
        quantize_experts_int4(experts, self.group_size)


class Fp8Weights(PerLayerMethod):
    """FP8 e4m3 weights, one scale per output channel (emulated on the CPU)."""

    name = "fp8"
    supports_experts = True

    def check_device(self, device: torch.device) -> None:
        """CUDA needs FP8 tensor cores; the CPU runs the emulated (dequantizing) path."""
        if device.type == "cuda" and not fp8_matmul_supported(device):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"quantization='fp8' needs a GPU with FP8 support (compute capability >= 8.9, "
                f"e.g. Ada or Hopper); {device} has {major}.{minor}. Use int8 instead."
            )
        if device.type == "cpu":
            logger.info("fp8 on the CPU: weights stored as e4m3, dequantized for each matmul")

    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        """Per-row scaled cast to float8_e4m3fn."""
        return Fp8Linear.from_float(linear)

    def quantize_experts(self, experts: nn.Module) -> None:
        """The same per output channel of every expert (quant/experts.py)."""
        quantize_experts_fp8(experts)
