"""RoPE settings and frequencies: a config's rope parameters as one flat dict, and the inverse
frequencies of each rope type ("default", "linear" position interpolation, Llama 3.1's
"llama3"), all computed once when a model is built (layers/rotary.py turns them into angles).

A new rope type is one function ``(inv_freq, params) -> inv_freq`` added to ``ROPE_SCALING``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def rope_parameters(config: Any) -> dict[str, Any]:
    """Return the RoPE settings as one flat dict with at least ``rope_type`` and ``rope_theta``.

    transformers 5.x keeps them in ``config.rope_parameters``; 4.x configs (and old config.json
    files) use ``rope_theta`` plus an optional ``rope_scaling`` dict whose type key is ``type``
    or ``rope_type``.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """Channels of each head that RoPE rotates (all but for partial rotary)."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in float32 on the CPU for the given RoPE settings."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_SCALING:
        raise ValueError(f"unsupported rope type '{rope_type}'; supported: {SUPPORTED_ROPE_TYPES}")
    dim = rotary_dim_of(head_dim, params)
    # Explicit device: models may be constructed under `with torch.device("meta")`.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    return ROPE_SCALING[rope_type](inv_freq, params)


def _linear_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Position interpolation: scaling positions by 1/factor == scaling frequencies by 1/factor."""
    return inv_freq / params["factor"]


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than old_len / low never fit in the pretraining context: interpolate them.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


# rope type -> how it changes the default inverse frequencies
ROPE_SCALING: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "default": lambda inv_freq, params: inv_freq,
    "linear": _linear_scale,
    "llama3": _llama3_scale,
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_SCALING)
