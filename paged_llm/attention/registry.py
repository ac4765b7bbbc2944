"""Attention backends by name."""

from __future__ import annotations

from paged_llm.attention.base import AttentionBackend
from paged_llm.utils.registry import resolve

ATTENTION_BACKENDS = {
    "torch": "paged_llm.attention.torch_backend.TorchAttentionBackend",
    "triton": "paged_llm.attention.triton_backend.TritonAttentionBackend",
    "contiguous": "paged_llm.attention.contiguous_backend.ContiguousAttentionBackend",
}


def get_attention_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """Instantiate a backend by name; ``auto`` means triton on CUDA and torch on the CPU."""
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    backend = resolve("attention backend", name, ATTENTION_BACKENDS)()
    return backend


def auto_backend() -> AttentionBackend:
    """The fast backend for this machine: triton with CUDA, torch otherwise."""
    import torch

    return get_attention_backend("auto", "cuda" if torch.cuda.is_available() else "cpu")
