"""The attention backend interface: store this step's K/V, then attend through the cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from paged_llm.attention.metadata import AttentionMetadata, build_attention_metadata


class AttentionBackend(ABC):
    """One way to lay out and read the KV cache. Chosen by config (``attention=torch|triton|...``).

    Shapes: ``query`` [T, Hq, D]; ``key``/``value`` [T, Hkv, D]; caches
    [num_blocks, block_size, Hkv, D]; returns [T, Hq, D]. A quantized cache (int8 / fp8,
    ``kv_cache_dtype``) also passes ``k_scale``/``v_scale`` [num_blocks, block_size, Hkv].
    A layer with sliding-window attention passes ``sliding_window=W``: each query then sees
    only its last W positions (itself included; see ``ops/paged_attention/reference.py``).
    """

    name: str = "base"
    # Backends that need each sequence's blocks to be one contiguous run (the pre-vLLM layout).
    requires_contiguous_blocks: bool = False
    # Backends that store into and read from a quantized cache with scales.
    supports_quantized_kv: bool = False
    # Backends whose forward has no host syncs and reads no per-step host-side values, so a
    # captured CUDA graph replays it correctly (``runner/cuda_graphs.py`` captures only these).
    # Mixed-step graphs (cudagraph_mode FULL) also need it to take padding: sequences with no
    # queries and no context, and, with ``meta.padded_tokens``, rows past the last query
    # offset, whose output must be left finite (zero).
    cuda_graph_safe: bool = False

    def check_device(self, device: torch.device) -> None:
        """Raise a clear error when this backend cannot run on ``device``."""

    # This step's metadata from host lists (decodes first): (query_lens [B], seq_lens [B],
    # block_tables [B][blocks of sequence b], block_size, device) -> AttentionMetadata.
    # metadata.py's builder itself, so a step enters no code of this file; override it (a
    # method with those arguments) for another layout.
    build_metadata = staticmethod(build_attention_metadata)

    def release_buffers(self) -> None:
        """Drop scratch memory kept between steps (sleep mode frees it); none by default."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write key/value into their slots, then return attention output for every query."""
