"""Resolving ``model=`` (a local checkpoint or a built-in preset), its tokenizer, the device."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_llm.config import ModelConfig
from paged_llm.layers.linear_setup import use_onednn_linears
from paged_llm.models import presets
from paged_llm.models.loader import resolve_dtype
from paged_llm.quant.checkpoint import load_checkpoint
from paged_llm.quant.registry import apply_quantization

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present; an explicit CUDA request without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' requested but CUDA is not available")
    return dev


def model_dtype(name: str, device: torch.device, hf_config: Any = None) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA, float32 on the CPU (fast and exact there)."""
    if name == "auto" and device.type == "cpu":
        return torch.float32
    return resolve_dtype(name, hf_config)


def load_tokenizer(path: str | Path) -> Any | None:
    """A local Hugging Face tokenizer, or None when the directory has none."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_model_and_tokenizer(
    mc: ModelConfig, device: torch.device
) -> tuple[nn.Module, Any, Any | None]:
    """Load a checkpoint directory, the tiny default, or a random-weight shape preset (its CPU
    linear layers switched to oneDNN for large inputs, see ``cpu_onednn_min_rows``)."""
    from paged_llm.models.registry import register_models

    register_models(mc.model_classes)  # architectures added by configuration alone
    model, hf_config, tokenizer = _load(mc, device)
    use_onednn_linears(model, mc.cpu_onednn_min_rows)
    return model, hf_config, tokenizer


def checkpoint_path(name: str) -> Path:
    """The directory that ``name`` names: itself, the tiny default materialised in the cache,
    or a built-in trained model (paged_llm/models/trained.py, e.g. ``code-small``), trained on
    first use and cached. It may not exist: then ``name`` is a shape preset or a mistake."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name.lower() == presets.DEFAULT_PRESET:
        return presets.default_model_dir()
    from paged_llm.models import trained

    if name not in trained.RECIPES:
        return path
    if not trained.is_built(name):
        took = trained.BUILD_TIME.get(name, "as long as its recipe takes")
        logger.info(
            "building the built-in model '%s' on first use (%s on 2 CPU cores; cached in %s)",
            name, took, trained.model_cache_path(name),
        )  # fmt: skip
    return trained.trained_model_dir(name)


def _load(mc: ModelConfig, device: torch.device) -> tuple[nn.Module, Any, Any | None]:
    """Load a checkpoint directory, the tiny default, or a random-weight shape preset."""
    name = str(mc.model)
    path = checkpoint_path(name)
    if path.exists():
        from paged_llm.models.loader import load_config

        dtype = model_dtype(mc.dtype, device, load_config(path))
        model, hf_config = load_checkpoint(path, dtype, device)  # plain, or GPTQ / AWQ
        tokenizer = load_tokenizer(Path(mc.tokenizer) if mc.tokenizer else path)
        return apply_quantization(model, mc.quantization, tokenizer), hf_config, tokenizer
    if name.lower() in presets.list_presets():
        dtype = model_dtype(mc.dtype, device, presets.preset_config(name))
        model, hf_config = presets.build_random_model(name, dtype, device, seed=mc.seed)
        tokenizer = load_tokenizer(Path(mc.tokenizer)) if mc.tokenizer else None
        return apply_quantization(model, mc.quantization, tokenizer), hf_config, tokenizer
    raise ValueError(
        f"model '{name}' is neither a local checkpoint directory, a built-in trained model "
        f"({', '.join(_trained_names())}) nor a random-weight preset "
        f"({', '.join(presets.list_presets())}); nothing is downloaded from a hub"
    )


def _trained_names() -> list[str]:
    from paged_llm.models import trained

    return sorted(trained.RECIPES)
