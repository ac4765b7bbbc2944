"""Attention backends by name."""

from __future__ import annotations

from paged_llm.attention.base import AttentionBackend
from paged_llm.utils.registry import resolve

ATTENTION_BACKENDS = {
    "torch": "paged_llm.attention.torch_backend.TorchAttentionBackend",
    "cpu": "paged_llm.attention.cpu_backend.CpuAttentionBackend",
    "triton": "paged_llm.attention.triton_backend.TritonAttentionBackend",
    "contiguous": "paged_llm.attention.contiguous_backend.ContiguousAttentionBackend",
}


def auto_backend_name(device: str) -> str:
    """What ``auto`` means on ``device``: triton on CUDA; on the CPU the native kernel's backend
    when it builds here (it needs a C++ compiler), else torch."""
    if str(device).startswith("cuda"):
        return "triton"
    from paged_llm.ops.paged_attention import cpu_native

    return "cpu" if cpu_native.is_available() else "torch"


def get_attention_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """Instantiate a backend by name (``auto``: see ``auto_backend_name``)."""
    if name == "auto":
        name = auto_backend_name(device)
    return resolve("attention backend", name, ATTENTION_BACKENDS)()


def auto_backend() -> AttentionBackend:
    """The fast backend for this machine: triton with CUDA, else the CPU's best."""
    import torch

    return get_attention_backend("auto", "cuda" if torch.cuda.is_available() else "cpu")
