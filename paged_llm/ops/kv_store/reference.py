"""Torch reference for the KV store op."""

from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, flat slot index; negative = skip (padding)
) -> None:
    """Scatter each token's K and V into ``cache.view(-1, Hkv, D)[slot]`` in place."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, key[valid].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value[valid].to(v_cache.dtype))
