"""What every weight-quantization method shares: which layers it touches and how it swaps them.

A method replaces ``nn.Linear`` modules inside the model's numbered blocks (the decoder layers,
``model.layers.<i>....``) with quantized layers from :mod:`paged_llm.quant.layers`. Embeddings
and the LM head stay in float, as in GPTQ and AWQ: they are a small share of a large model's
weights and quantizing them costs the most accuracy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

import torch
from torch import nn

from paged_llm.quant.layers import check_int4_layers
from paged_llm.quant.parallel import PARALLEL_LINEARS, quantize_parallel_linear


def block_of(name: str) -> str | None:
    """The numbered block of a module: ``model.layers.3.mlp.up_proj`` -> ``model.layers.3``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def linears_by_block(model: nn.Module) -> OrderedDict[str, list[str]]:
    """Names of the plain ``nn.Linear`` layers (or their tensor-parallel forms) of each numbered
    block, in forward order (routers, a subclass of their own, are not among them)."""
    blocks: OrderedDict[str, list[str]] = OrderedDict()
    for name, module in model.named_modules():
        block = block_of(name)
        if (type(module) is nn.Linear or type(module) in PARALLEL_LINEARS) and block is not None:
            blocks.setdefault(block, []).append(name)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear layers inside numbered blocks to quantize "
            "(is it already quantized?)"
        )
    return blocks


def block_linear_names(model: nn.Module) -> list[str]:
    """Every quantizable linear layer's name, block by block."""
    return [name for names in linears_by_block(model).values() for name in names]


class Int4GroupCheck:
    """Mixed into an int4 method with a ``group_size``: its ``check_model`` refuses a model
    whose block linears the group size does not divide (shapes only)."""

    name: str
    group_size: int

    def check_model(self, model: nn.Module) -> None:
        """Every block linear's shape must suit int4 with this group size."""
        check_int4_layers(model, block_linear_names(model), self.group_size, self.name)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule called ``name`` (dotted path) by ``module``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter."""
    return next(model.parameters()).device


class QuantMethod(ABC):
    """A weight-quantization method; configured by its constructor arguments (the config)."""

    name: str = "base"
    needs_calibration: bool = False  # GPTQ / AWQ need activations from calibration text
    supports_experts: bool = False  # can quantize mixture-of-experts weights (quantize_experts)
    # can quantize each rank's shard of a tensor-parallel model (quant/parallel.py)
    supports_tensor_parallel: bool = False

    def check_device(self, device: torch.device) -> None:
        """Raise a clear error when this method cannot run on ``device``."""

    def check_model(self, model: nn.Module) -> None:
        """Raise a clear error when ``model``'s layers cannot take this method (shapes only:
        it runs on a meta-device model before any weights load)."""

    @abstractmethod
    def quantize(self, model: nn.Module, calibration: torch.Tensor | None) -> nn.Module:
        """Swap the model's linear layers in place; ``calibration`` is [N, L] token ids."""

    def quantize_experts(self, experts: nn.Module) -> None:
        """Quantize one ``layers.moe.FusedExperts`` in place (methods with supports_experts)."""
        raise NotImplementedError(f"{self.name} does not quantize mixture-of-experts weights")


class PerLayerMethod(QuantMethod):
    """A method that quantizes each linear layer on its own, from its weight alone."""

    supports_tensor_parallel = True  # a rank's shard is quantized like a layer of its own

    @abstractmethod
    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        """The quantized replacement of one layer."""

    @torch.no_grad()
    def quantize(self, model: nn.Module, calibration: torch.Tensor | None = None) -> nn.Module:
        """Replace every block linear by :meth:`quantize_linear` of it."""
        self.check_device(model_device(model))
        for names in linears_by_block(model).values():
            for name in names:
                set_module(model, name, quantize_named(self, name, model.get_submodule(name)))
        return model


def quantize_named(method: PerLayerMethod, name: str, linear: nn.Linear) -> nn.Module:
    """``method.quantize_linear(linear)``, with the layer's name in any error."""
    try:
        if isinstance(linear, PARALLEL_LINEARS):
            return quantize_parallel_linear(method.quantize_linear, linear)
        return method.quantize_linear(linear)
    except ValueError as err:
        raise ValueError(f"{method.name}: layer '{name}': {err}") from None
