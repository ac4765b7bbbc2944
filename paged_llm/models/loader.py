"""Load an HF checkpoint directory (config.json + weights) into one of our models, and read
its config (per-head width, K/V heads, sliding windows: what the models and the KV cache need).

Everything is read from the local directory: the config goes through
``AutoConfig.from_pretrained(..., local_files_only=True)`` and a missing directory is refused
before transformers could mistake the path for a Hub repo id, so nothing is ever downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_llm.models.checkpoint import find_weight_files, iter_weight_files
from paged_llm.models.registry import get_model_class

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str, hf_config: Any = None) -> torch.dtype:
    """A torch dtype from a dtype or its name; ``"auto"`` takes the checkpoint's (else float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        saved = str(saved).removeprefix("torch.") if saved is not None else "float32"
        return _DTYPES.get(saved, torch.float32)
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"unsupported dtype '{dtype}'; choose one of {sorted(_DTYPES)} or auto"
        ) from None


def load_config(model_dir: str | Path) -> Any:
    """Read ``model_dir/config.json`` with transformers, offline."""
    from transformers import AutoConfig  # heavy import, only when a model is actually loaded

    model_dir = Path(model_dir).expanduser().resolve()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def instantiate_model(config: Any, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Our model for ``config`` with uninitialised parameters of ``dtype`` on ``device``."""
    model_cls = get_model_class(config)
    # Build on the meta device: no memory and no random init, which would be wasted work
    # (minutes for a 13B model on a CPU) since every parameter is overwritten afterwards.
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module new storage; re-share the tied head
    return model


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, Any]:
    """Load the checkpoint in ``model_dir``; return (model in eval mode, HF config)."""
    model_dir = Path(model_dir).expanduser().resolve()
    hf_config = load_config(model_dir)
    get_model_class(hf_config)  # fail on an unsupported architecture before reading weights
    files = find_weight_files(model_dir)
    model = instantiate_model(hf_config, resolve_dtype(dtype, hf_config), device)
    model.load_weights(iter_weight_files(files))
    return model.eval(), hf_config


def head_dim_of(config: Any) -> int:
    """Per-head width: ``config.head_dim`` when set (Mistral/Qwen variants), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    """Number of K/V heads (grouped-query attention); plain multi-head models have one per query."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """Sliding window of layer ``layer_idx`` (None: full attention), read as transformers does:
    ``sliding_window`` when set and not switched off by ``use_sliding_window`` (Qwen), on the
    layers ``layer_types`` marks "sliding_attention", or on every layer without ``layer_types``
    (Mistral, Mixtral, Qwen3-MoE)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


def kv_cache_shape_info(hf_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim): what the KV cache allocator needs per layer."""
    return hf_config.num_hidden_layers, num_kv_heads_of(hf_config), head_dim_of(hf_config)


def max_context_len(hf_config: Any) -> int:
    """Longest context the model runs correctly here: its position limit (a sliding window
    does not cap it: windowed layers attend to their last W positions at any length)."""
    return hf_config.max_position_embeddings
