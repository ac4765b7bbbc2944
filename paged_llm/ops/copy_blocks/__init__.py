"""Copy whole KV blocks inside a cache (copy-on-write of shared blocks, in-device swaps)."""

from __future__ import annotations

import torch

from paged_llm.ops.copy_blocks.reference import copy_blocks_reference


def copy_blocks(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    src: torch.Tensor,  # [N] int64 source block ids
    dst: torch.Tensor,  # [N] int64 destination block ids
) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` of both caches in place (Triton on CUDA)."""
    if k_cache.is_cuda:
        # Imported lazily so CPU-only code paths never need a working Triton backend.
        from paged_llm.ops.copy_blocks.triton import copy_blocks_triton

        copy_blocks_triton(k_cache, v_cache, src, dst)
    else:
        copy_blocks_reference(k_cache, v_cache, src, dst)


__all__ = ["copy_blocks"]
