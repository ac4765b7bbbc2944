"""Triton batched multi-LoRA (Punica / S-LoRA "BGMV"): every token multiplies by its own adapter.

Same contract as ``reference.add_lora_reference``. Tokens of one batch use different adapters,
so the update is two gathered matrix-vector products per token rather than one GEMM:

* shrink, grid (T, cdiv(R, BLOCK_R)): ``v[t, r] = x[t] . A[slot_t, r]``, reducing over K in
  ``BLOCK_K`` tiles, into a float32 buffer [T, R];
* expand, grid (T, cdiv(N, BLOCK_N)): ``y[t, n] += v[t] . B[slot_t, n]``, read-modify-write of
  y's tile, accumulated in float32 and rounded to y's dtype once.

A program whose token has slot -1 returns before reading any weight, so tokens without an
adapter cost one load. Tokens that share an adapter read the same A / B rows, which stay in L2.
The products are broadcast multiplies summed on the CUDA cores, not ``tl.dot``: a program owns a
single token, and ``tl.dot`` would pad it to 16 rows (and the interpreter's bf16 dot is wrong).
Splitting two kernels keeps v in float32 and lets y alias x: every shrink has read x before
the first expand writes y.

Slots must be below S: the kernels do not check (that would cost a device sync per call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_llm.ops.lora.reference import check_lora_args

# Elements of one weight tile per program ([BLOCK_R, BLOCK_K] or [BLOCK_N, BLOCK_R]): 32 fp32
# values per thread at 4 warps, enough loads in flight without spilling registers.
TILE_ELEMENTS = 4096
MAX_BLOCK_R_SHRINK = 64  # larger ranks take several programs per token (more parallelism)
MAX_BLOCK_R_EXPAND = 128  # the usual ranks (<= 128) fit one tile; larger ones loop over R


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K] any strides
    a_ptr,  # [S, R, K] any strides
    slots_ptr,  # [T] int32 / int64
    v_ptr,  # [T, R] float32, contiguous
    rank,
    in_features,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    BLOCK_R: tl.constexpr,  # power of two, masked past R
    BLOCK_K: tl.constexpr,  # power of two, masked past K
):
    """One program per (token, R tile): ``v[t, tile] = A[slot, tile, :] @ x[t]`` in float32."""
    token = tl.program_id(0).to(tl.int64)  # int64: T * stride may pass 2**31
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:  # no adapter: v[t] stays unwritten and expand skips the token too
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask_r = offs_r < rank
    a_rows = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar  # [BLOCK_R, 1]
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < in_features
        x = tl.load(x_ptr + token * stride_xt + offs_k * stride_xk, mask=mask_k, other=0.0)
        a = tl.load(
            a_rows + offs_k[None, :] * stride_ak, mask=mask_r[:, None] & mask_k[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(v_ptr + token * rank + offs_r, acc, mask=mask_r)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, N] any strides, updated in place
    b_ptr,  # [S, N, R] any strides
    slots_ptr,  # [T] int32 / int64
    v_ptr,  # [T, R] float32, contiguous (from the shrink kernel)
    rank,
    out_features,
    stride_yt,
    stride_yn,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_N: tl.constexpr,  # power of two, masked past N
    BLOCK_R: tl.constexpr,  # power of two, masked past R
):
    """One program per (token, N tile): ``y[t, tile] += B[slot, tile, :] @ v[t]``, one rounding."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:  # no adapter: y's row is left bit-identical
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < out_features
    b_rows = b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # a single iteration for ranks up to MAX_BLOCK_R_EXPAND
        offs_r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        mask_r = offs_r < rank
        v = tl.load(v_ptr + token * rank + offs_r, mask=mask_r, other=0.0)
        b = tl.load(
            b_rows + offs_r[None, :] * stride_br, mask=mask_n[:, None] & mask_r[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R]
        acc += tl.sum(b.to(tl.float32) * v[None, :], axis=1)
    y_tile = y_ptr + token * stride_yt + offs_n * stride_yn
    y = tl.load(y_tile, mask=mask_n, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


def _pow2_tile(size: int, cap: int) -> int:
    """``size`` padded to a power of two, at least 16 (no 1-wide aranges on a GPU) and at most
    ``cap`` (itself a power of two); masks cover the padding."""
    return min(cap, max(16, triton.next_power_of_2(size)))


def add_lora_triton(
    y: torch.Tensor,  # [T, N] base layer output, updated in place (any strides)
    x: torch.Tensor,  # [T, K] layer input (any strides)
    lora_a: torch.Tensor,  # [S, R, K] A of each adapter slot (rank padded with zero rows)
    lora_b: torch.Tensor,  # [S, N, R] B of each slot, scaling folded in (padded columns zero)
    token_slots: torch.Tensor,  # [T] int32/int64 slot of each token's adapter, -1 = none
    *,
    block_k: int | None = None,  # tile overrides (powers of two); tests use small ones
    block_n: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """Add ``(x[t] @ lora_a[s].T) @ lora_b[s].T`` to ``y[t]`` for each token's slot s; return y."""
    check_lora_args(y, x, lora_a, lora_b, token_slots)
    num_tokens, out_features = y.shape
    _, rank, in_features = lora_a.shape
    if num_tokens == 0 or out_features == 0 or rank == 0:
        return y  # nothing to add (a rank-0 update is zero)
    for name, block in (("block_k", block_k), ("block_n", block_n), ("block_r", block_r)):
        if block is not None and (block < 1 or block & (block - 1)):
            raise ValueError(f"add_lora: {name} must be a power of two, got {block}")

    # float32 [T, R]: the intermediate is not rounded to the activation dtype.
    v = torch.empty(num_tokens, rank, dtype=torch.float32, device=y.device)
    block_r_shrink = block_r or _pow2_tile(rank, MAX_BLOCK_R_SHRINK)
    block_k = block_k or _pow2_tile(in_features, max(16, TILE_ELEMENTS // block_r_shrink))
    _lora_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r_shrink))](
        x,
        lora_a,
        token_slots,
        v,
        rank,
        in_features,
        *x.stride(),
        *lora_a.stride(),
        BLOCK_R=block_r_shrink,
        BLOCK_K=block_k,
    )

    block_r_expand = block_r or _pow2_tile(rank, MAX_BLOCK_R_EXPAND)
    block_n = block_n or _pow2_tile(out_features, max(16, TILE_ELEMENTS // block_r_expand))
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        y,
        lora_b,
        token_slots,
        v,
        rank,
        out_features,
        *y.stride(),
        *lora_b.stride(),
        BLOCK_N=block_n,
        BLOCK_R=block_r_expand,
    )
    return y
