"""Allocation of the per-layer KV pools and block moves between them."""

from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v) [blocks, bs, Hkv, D]


def kv_bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,  # quantized cache: one scale per (token, head)
) -> int:
    """Bytes one block occupies across all layers, K and V (and their scales, if any)."""
    elem = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=scale_dtype).element_size() if scale_dtype else 0
    return 2 * num_layers * block_size * num_kv_heads * (head_dim * elem + scale)


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


def allocate_kv_scales(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> KVCaches:
    """Per layer (k_scale, v_scale) [num_blocks, block_size, Hkv] for a quantized cache: the
    same slots as the cache, so block moves treat them exactly like the caches."""
    pools = allocate_kv_caches(
        num_layers, num_blocks, block_size, num_kv_heads, 1, dtype, device, pin_memory
    )
    return [(k[..., 0], v[..., 0]) for k, v in pools]


def move_blocks(
    src: list[tuple[torch.Tensor, ...]], dst: list[tuple[torch.Tensor, ...]],
    mapping: list[tuple[int, int]],
) -> None:  # fmt: skip
    """Copy block src_id of every pool in ``src`` (per layer (k, v), or any tuple of tensors
    indexed by block first) to block dst_id of the matching pool in ``dst``."""
    if not mapping:
        return
    src_ids = torch.tensor([s for s, _ in mapping], dtype=torch.long)
    dst_ids = torch.tensor([d for _, d in mapping], dtype=torch.long)
    # (an offload tier's list is shorter: it carries no companions' pools)
    for src_group, dst_group in zip(src, dst):
        for src_t, dst_t in zip(src_group, dst_group, strict=True):
            rows = src_t.index_select(0, src_ids.to(src_t.device)).to(dst_t.device)
            # Indexed assignment rather than index_copy_, which has no float8 (fp8 cache) kernel.
            dst_t[dst_ids.to(dst_t.device)] = rows
