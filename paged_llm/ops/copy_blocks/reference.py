"""Torch reference for copying whole KV blocks."""

from __future__ import annotations

import torch


def copy_blocks_reference(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    src: torch.Tensor,  # [N] int64 source block ids
    dst: torch.Tensor,  # [N] int64 destination block ids, distinct and disjoint from src
) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` of both caches in place."""
    for cache in (k_cache, v_cache):
        # index_select makes a copy first, so every read sees the cache before any write.
        cache.index_copy_(0, dst, cache.index_select(0, src))
