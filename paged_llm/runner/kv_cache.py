"""Allocation of the per-layer KV pools and block moves between them."""

from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v) [blocks, bs, Hkv, D]


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block occupies across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> KVCaches:
    """One zeroed [num_blocks, block_size, Hkv, D] pool for K and one for V, per layer."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
        )
        for _ in range(num_layers)
    ]


def move_blocks(src: KVCaches, dst: KVCaches, mapping: list[tuple[int, int]]) -> None:
    """Copy block src_id of every layer's pools in ``src`` to block dst_id in ``dst``."""
    if not mapping:
        return
    src_ids = torch.tensor([s for s, _ in mapping], dtype=torch.long)
    dst_ids = torch.tensor([d for _, d in mapping], dtype=torch.long)
    for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
        s_idx = src_ids.to(src_k.device)
        d_idx = dst_ids.to(dst_k.device)
        dst_k.index_copy_(0, d_idx, src_k.index_select(0, s_idx).to(dst_k.device))
        dst_v.index_copy_(0, d_idx, src_v.index_select(0, s_idx).to(dst_v.device))
