"""The checkpoint a benchmark loads, from the ``model`` group: a local directory
(``model.path``, or ``model=local model.model=DIR``), a preset written once into the cache
(``model.preset``, or ``model=tiny`` / ``model=opt-125m`` ...), or a random Llama of the shape in
``model.arch`` (``model=random_llama``, the throughput default)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import OmegaConf

from experiments.common.checkpoints import cached, save_random_llama


def _arch(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.arch`` fields as a plain dict."""
    arch = cfg["arch"]
    return OmegaConf.to_container(arch, resolve=True) if OmegaConf.is_config(arch) else dict(arch)


def _path(cfg: Mapping[str, Any]) -> Path | None:
    """The local checkpoint directory the config names, if any."""
    path = cfg.get("path") or (cfg.get("model") if Path(str(cfg.get("model"))).is_dir() else None)
    return Path(hydra.utils.to_absolute_path(str(path))) if path else None


def preset_name(cfg: Mapping[str, Any]) -> str:
    """The preset the config names (``model.preset``, else the group's ``model.model``)."""
    return str(cfg.get("preset") or cfg.get("model"))


def hf_config(cfg: Mapping[str, Any]) -> Any:
    """The model's transformers config, without writing or loading any weights."""
    from transformers import AutoConfig, LlamaConfig

    from paged_llm.models import presets

    if _path(cfg) is not None:
        return AutoConfig.from_pretrained(str(_path(cfg)))
    if not cfg.get("preset") and cfg.get("arch"):
        return LlamaConfig(**_arch(cfg), architectures=["LlamaForCausalLM"])
    name = preset_name(cfg)
    if name not in presets.list_presets():
        raise ValueError(
            f"model '{name}' is neither a directory nor a preset; choose one of "
            f"{presets.list_presets()}, model=local model.model=DIR, or model=random_llama"
        )
    return presets.preset_config(name)


def resolve_model_dir(cfg: Mapping[str, Any], dtype: torch.dtype, seed: int) -> Path:
    """A local HF checkpoint both engines load: the given path, a preset, or a cached Llama."""
    from paged_llm.models import presets

    path = _path(cfg)
    if path is not None:
        return path
    if cfg.get("preset") or not cfg.get("arch"):
        name = preset_name(cfg)
        dtype_name = str(dtype).removeprefix("torch.")
        out = presets.cache_root() / f"preset-{name}-seed{seed}-{dtype_name}"
        return cached(out, lambda tmp: presets.materialize_preset(name, tmp, seed, dtype))
    arch = _arch(cfg)
    key = json.dumps({"arch": arch, "seed": seed, "dtype": str(dtype)}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = presets.cache_root() / f"throughput-llama-{digest}"
    return cached(out, lambda tmp: save_random_llama(arch, tmp, dtype, seed))
