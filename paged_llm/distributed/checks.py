"""Every reason ``tensor_parallel_size=N`` cannot run a configuration, checked in one place
before any worker process starts, so each raises a ValueError naming the problem."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paged_llm.distributed.parallel_state import SPAWNED_ENV
from paged_llm.distributed.sharding import kv_heads_per_rank


def model_hf_config(model: str) -> Any:
    """The HF config of ``model=`` (a checkpoint directory, "tiny" or a shape preset), read
    without loading any weights."""
    from paged_llm.models import presets
    from paged_llm.models.loader import load_config

    path = Path(str(model)).expanduser()
    if not path.exists() and str(model).lower() == presets.DEFAULT_PRESET:
        path = presets.default_model_dir()
    if path.exists():
        return load_config(path)
    return presets.preset_config(str(model))  # raises naming the accepted presets


def check_tensor_parallel(config: Any, hf_config: Any) -> None:
    """Raise ValueError when EngineConfig ``config`` cannot run with its tensor_parallel_size."""
    mc = config.model
    n = mc.tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    if n == 1:
        return
    _check_features(config, hf_config)
    _check_shapes(hf_config, n)
    if mc.enable_expert_parallel:
        _check_experts(hf_config, n)
    _check_devices(mc.device, n)


def _check_features(config: Any, hf_config: Any) -> None:
    """Features that do not run split across ranks yet."""
    from paged_llm.quant.checkpoint import PREQUANTIZED_METHODS
    from paged_llm.quant.registry import NO_QUANTIZATION, build_method

    mc = config.model
    unsupported = []
    if mc.quantization not in NO_QUANTIZATION:
        prequantized = mc.quantization in PREQUANTIZED_METHODS  # names the checkpoint's own
        method = None if prequantized else build_method(mc.quantization)
        if not prequantized and not method.supports_tensor_parallel:
            unsupported.append(
                f"weight quantization with calibration (quantization={mc.quantization!r}; "
                "int8, fp8 and int4_rtn quantize each rank's shard)"
            )
    quantized = mc.quantization not in NO_QUANTIZATION or hasattr(hf_config, "quantization_config")
    if config.lora.enable_lora and quantized:
        unsupported.append("LoRA adapters on quantized weights (LoRA on float weights runs)")
    spec = dict(config.speculative_config or {})
    # The same default as spec.registry.build_drafter: a "model" means drafting with a model.
    method = spec.get("method") or ("draft_model" if "model" in spec else "ngram")
    if spec and "_target_" in spec:
        unsupported.append("a custom speculative drafter (_target_)")
    elif spec and method not in ("ngram", "draft_model", "eagle"):
        unsupported.append(f"speculative method {method!r} (ngram, draft_model and eagle run)")
    if unsupported:
        raise ValueError(
            f"tensor_parallel_size={mc.tensor_parallel_size} does not support "
            f"{'; '.join(unsupported)} yet; use tensor_parallel_size=1 for these"
        )


def _check_experts(hf_config: Any, n: int) -> None:
    """Expert parallelism places E / n whole experts on each rank."""
    from paged_llm.models.registry import get_model_class

    model_class = get_model_class(hf_config)
    experts = model_class.num_experts(hf_config) if hasattr(model_class, "num_experts") else None
    if experts is None:
        raise ValueError(
            "enable_expert_parallel needs a mixture-of-experts model; "
            f"{type(hf_config).__name__} has no experts"
        )
    if experts % n:
        raise ValueError(
            f"enable_expert_parallel: {experts} experts do not split evenly over "
            f"tensor_parallel_size={n}"
        )


def _check_shapes(hf_config: Any, n: int) -> None:
    """Heads, K/V heads and MLP width must split evenly over n ranks (any vocabulary does:
    its shards are padded)."""
    sizes = {"num_attention_heads": hf_config.num_attention_heads}
    inter = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", None)
    if inter:
        sizes["intermediate size (intermediate_size / ffn_dim)"] = inter
    bad = [f"{name} ({value})" for name, value in sizes.items() if value % n]
    if bad:
        raise ValueError(f"{', '.join(bad)} not divisible by tensor_parallel_size={n}")
    kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    kv_heads_per_rank(kv, n)  # raises when K/V heads neither split nor replicate evenly


def _check_devices(device: str, n: int) -> None:
    """One device per rank: the CPU, or CUDA device <local rank> on each node."""
    import torch

    if device.startswith("cuda:"):
        raise ValueError(
            f"device='{device}' names one GPU, but tensor_parallel_size={n} uses one per rank "
            "(cuda:<local rank>); pass device='cuda' or 'auto'"
        )
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and "LOCAL_WORLD_SIZE" not in os.environ and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size={n} needs {n} GPUs on this node; "
            f"{torch.cuda.device_count()} visible"
        )
    world = os.environ.get("WORLD_SIZE")
    if world is not None and SPAWNED_ENV not in os.environ and int(world) != n:
        raise ValueError(
            f"running in a torch.distributed world of {world} processes (WORLD_SIZE), but "
            f"tensor_parallel_size={n}; only tensor parallelism over the whole world is supported"
        )
