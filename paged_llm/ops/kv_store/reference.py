"""Torch reference for the KV store op."""

from __future__ import annotations

import torch

from paged_llm.quant.kv_cache import spec_for_cache


def store_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, flat slot index; negative = skip (padding)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] float32: quantized cache
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K and V into ``cache.view(-1, Hkv, D)[slot]`` in place; with scale
    pools (int8 / fp8 cache) each vector is quantized and its scale stored in the same slot."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if k_scale is None:
        flat_k.index_copy_(0, slots, key[valid].to(k_cache.dtype))
        flat_v.index_copy_(0, slots, value[valid].to(v_cache.dtype))
        return
    spec = spec_for_cache(k_cache)
    for x, flat, scale in ((key, flat_k, k_scale), (value, flat_v, v_scale)):
        codes, s = spec.quantize(x[valid])
        flat[slots] = codes  # index_put: index_copy_ has no float8 kernel on the CPU
        scale.view(-1, scale.shape[-1])[slots] = s
