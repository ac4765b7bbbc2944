"""Triton block copy: ``cache[dst[i]] = cache[src[i]]`` for K and V in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    src_ptr,  # [N] int64
    dst_ptr,  # [N] int64
    num_kv_heads,
    head_dim,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    BLOCK_H: tl.constexpr,  # next_power_of_2(Hkv)
    BLOCK_D: tl.constexpr,  # next_power_of_2(D)
):
    """One program per (pair, slot in block): copy that slot's K and V for all heads."""
    pair = tl.program_id(0)
    slot = tl.program_id(1)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k_inner = (
        slot * stride_kc_slot + offs_h[:, None] * stride_kc_head + offs_d[None, :] * stride_kc_dim
    )
    k = tl.load(k_cache_ptr + src * stride_kc_block + k_inner, mask=mask)
    tl.store(k_cache_ptr + dst * stride_kc_block + k_inner, k, mask=mask)

    v_inner = (
        slot * stride_vc_slot + offs_h[:, None] * stride_vc_head + offs_d[None, :] * stride_vc_dim
    )
    v = tl.load(v_cache_ptr + src * stride_vc_block + v_inner, mask=mask)
    tl.store(v_cache_ptr + dst * stride_vc_block + v_inner, v, mask=mask)


def copy_blocks_triton(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    src: torch.Tensor,  # [N] int64 source block ids
    dst: torch.Tensor,  # [N] int64 destination block ids, distinct and disjoint from src
) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` of both caches in place.

    All pairs run in parallel, so (unlike a sequential loop) a block that is both written and
    read in the same call would race: callers pass distinct destinations that are not sources,
    which copy-on-write and swapping guarantee.
    """
    if k_cache.shape != v_cache.shape or src.shape != dst.shape or src.dim() != 1:
        raise ValueError("k/v caches must match and src/dst must be 1-D tensors of equal length")
    num_pairs = src.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_pairs == 0:
        return
    _copy_blocks_kernel[(num_pairs, block_size)](
        k_cache,
        v_cache,
        src.to(torch.int64),
        dst.to(torch.int64),
        num_kv_heads,
        head_dim,
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
