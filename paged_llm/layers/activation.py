"""Activation functions by the names HF configs use (``hidden_act`` / ``activation_function``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    # HF's "gelu_new" is the tanh approximation written out by hand; same function.
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the activation called ``name`` or raise a ValueError listing the known ones."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation '{name}'; known: {sorted(ACTIVATIONS)}") from None
