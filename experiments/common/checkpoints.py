"""Random transformers Llama checkpoints for the benchmarks: any shape, the tiny one the smoke
runs share, and a write-once cache directory for them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Peaky logits (initializer_range 0.2), so greedy choices are not near-ties between engines.
TINY_LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "initializer_range": 0.2}  # fmt: skip


def save_random_llama(arch: dict[str, Any], out_dir: Path, dtype: torch.dtype, seed: int) -> None:
    """Write a random-initialised transformers Llama with these config fields to out_dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**arch, architectures=["LlamaForCausalLM"])
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(str(out_dir))


def save_tiny_llama(out_dir: Path, max_positions: int = 128) -> Path:
    """The tiny random Llama of the smoke runs (both engines load the same weights)."""
    arch = {**TINY_LLAMA, "max_position_embeddings": max_positions}
    save_random_llama(arch, out_dir, torch.float32, seed=0)
    return out_dir


def cached(final: Path, write: Callable[[Path], object]) -> Path:
    """Return final, first writing it via write(tmp_dir) and an atomic rename if absent."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
