"""A random-weight Llama checkpoint of a given shape, written once into the cache.

Step cost does not depend on the weights' values, and every request is forced to its recorded
output length (``ignore_eos``), so an untrained model times like a trained one of its shape.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from paged_llm.recipes.cache import cache_root, cached_dir

CACHE_VERSION = "v1"  # bump when what is written changes


@dataclass(frozen=True)
class RandomLlama:
    """The Llama shape to build (the default: ~25M parameters, the issue's CI-size model)."""

    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    vocab_size: int = 4096
    seed: int = 0

    def key(self) -> str:
        """Cache key of this shape."""
        blob = json.dumps([CACHE_VERSION, asdict(self)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def random_llama_dir(spec: RandomLlama) -> Path:
    """The checkpoint directory of ``spec`` (built on first use; safe under concurrency)."""
    return cached_dir(cache_root() / f"random-llama-{spec.key()}", lambda d: _write(spec, d))


def _write(spec: RandomLlama, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from paged_llm.recipes.training import ModelShape, llama_config

    shape = ModelShape(
        spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers,
        spec.num_attention_heads, spec.num_key_value_heads,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(llama_config(shape, spec.vocab_size))
    model.save_pretrained(str(out))
