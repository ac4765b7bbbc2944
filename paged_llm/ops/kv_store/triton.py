"""Triton KV store: scatter this step's K/V vectors into their paged cache slots.

Same contract as ``attention.torch_backend.store_kv_reference``: token t goes to flat slot
``slot_mapping[t] = block_id * block_size + offset``; a negative slot (padding) is skipped.
With scale pools (an int8 / fp8 cache) each head vector is quantized by its absmax on the way
in and its scale stored in the same slot of the scale pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_llm.quant.kv_cache import spec_for_cache


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    k_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (only read when QUANT)
    v_scale_ptr,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    stride_s_block,  # strides of both scale pools
    stride_s_slot,
    stride_s_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (power of two)
    BLOCK_H: tl.constexpr,  # next_power_of_2(Hkv)
    BLOCK_D: tl.constexpr,  # next_power_of_2(D)
    QUANT: tl.constexpr,  # quantize into an int8 / fp8 cache with per-(token, head) scales
    QMAX: tl.constexpr,  # largest code magnitude: 127 (int8) or 448 (fp8 e4m3)
    INT_CODES: tl.constexpr,  # int8 codes (else fp8 e4m3)
):
    """One program per token: copy all of its heads' K and V vectors into the token's slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token: nothing to store
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )
    if QUANT:
        s_offs = block_id * stride_s_block + offset * stride_s_slot + offs_h * stride_s_head
        k = _quantize_rows(k, k_scale_ptr + s_offs, offs_h < num_kv_heads, QMAX, INT_CODES)
        v = _quantize_rows(v, v_scale_ptr + s_offs, offs_h < num_kv_heads, QMAX, INT_CODES)
    kc = (
        k_cache_ptr
        + block_id * stride_kc_block
        + offset * stride_kc_slot
        + offs_h[:, None] * stride_kc_head
        + offs_d[None, :] * stride_kc_dim
    )
    vc = (
        v_cache_ptr
        + block_id * stride_vc_block
        + offset * stride_vc_slot
        + offs_h[:, None] * stride_vc_head
        + offs_d[None, :] * stride_vc_dim
    )
    # Cast explicitly so a cache kept in a narrower dtype than the activations still works.
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(y):
    """Round float32 values (|y| <= 448) to the nearest fp8 e4m3 value, ties to even.

    Done in float32 so the later cast is exact: the same result as torch everywhere (Triton's
    CPU interpreter mis-rounds float8 casts at the edges of each binade).
    """
    a = tl.abs(y)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # exponent of |y|
    step_exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; subnormals share the lowest step
    # Adding 1.5 * 2**(step_exp + 23) leaves float32 no bits below 2**step_exp: the add rounds
    # |y| to a multiple of the step (to even), and the subtraction is then exact.
    magic = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (a + magic) - magic
    return tl.where(y < 0, -r, r)


@triton.jit
def _quantize_rows(x, scale_ptrs, h_mask, QMAX: tl.constexpr, INT_CODES: tl.constexpr):
    """Scale each row of ``x`` [BLOCK_H, BLOCK_D] by absmax / QMAX, store the scales, return
    the codes (still float32, exactly representable; the caller's store casts them)."""
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / QMAX, 1e-12)  # all-zero rows stay zero
    tl.store(scale_ptrs, scale, mask=h_mask)
    y = tl.minimum(tl.maximum(x / scale[:, None], -QMAX), QMAX)
    if INT_CODES:  # to the nearest integer, ties to even like torch.round (a cast truncates)
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: the same trick as _round_to_e4m3
    else:
        y = _round_to_e4m3(y)
    return y


def store_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, flat slot index; negative = skip (padding)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] float32: quantized cache
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter each token's K and V into ``cache.view(-1, Hkv, D)[slot]`` in place (quantized,
    with their scales, when scale pools are given)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} disagree"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"caches {tuple(k_cache.shape)} do not hold [*, *, {num_kv_heads}, {head_dim}]"
        )
    if num_tokens == 0:
        return
    quant = k_scale is not None
    if quant:
        spec = spec_for_cache(k_cache)
        fp8 = k_cache.dtype.is_floating_point
        if fp8 and k_cache.is_cuda and torch.cuda.get_device_capability(k_cache.device) < (8, 9):
            raise ValueError(
                "an fp8_e4m3 KV cache with the triton backend needs a GPU with FP8 support "
                "(compute capability >= 8.9); use kv_cache_dtype='int8' here"
            )
        if k_scale.shape != k_cache.shape[:3] or v_scale.stride() != k_scale.stride():
            raise ValueError(f"scale pools must be {tuple(k_cache.shape[:3])}, alike in layout")
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.to(torch.int64),
        k_scale if quant else k_cache,  # an unused dummy pointer without quantization
        v_scale if quant else v_cache,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *(k_scale.stride() if quant else (0, 0, 0)),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant,
        QMAX=spec.qmax if quant else 1.0,
        INT_CODES=not k_cache.dtype.is_floating_point,
    )
