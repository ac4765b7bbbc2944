"""4-bit packing in the two common checkpoint layouts, eight values to an int32.

A 4-bit weight matrix is ``q`` [K = in_features, N = out_features] with values 0..15, zero
points ``z`` [G = K / group_size, N] and scales ``s`` [G, N]; the weight is
``W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``.

* GPTQ (AutoGPTQ / transformers, ``checkpoint_format: gptq``): ``qweight`` [K/8, N] packs eight
  consecutive input rows (row k at bits 4*(k % 8)); ``qzeros`` [G, N/8] packs eight consecutive
  output columns the same way and stores ``z - 1`` (a historical off-by-one every GPTQ kernel
  undoes by adding 1); ``g_idx`` [K] maps each input row to its group.
* AWQ (AutoAWQ GEMM): ``qweight`` [K, N/8] and ``qzeros`` [G, N/8] both pack along the output
  dimension, in the interleaved order ``AWQ_ORDER`` (bits 4*i hold column ``AWQ_ORDER[i]`` of
  each group of eight); zeros are stored as they are; there is no g_idx.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column held by nibble i of an AWQ-packed int32
IDENTITY_ORDER = tuple(range(8))


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """Reinterpret values in [0, 2**32) held in int64 as int32 bit patterns (two's complement)."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def pack_int4(q: torch.Tensor, dim: int, order: tuple[int, ...] = IDENTITY_ORDER) -> torch.Tensor:
    """Pack a 2-D tensor of values 0..15 eight to an int32 along ``dim`` (0 or 1).

    Nibble i (bits 4*i) of each int32 holds element ``order[i]`` of its group of eight.
    """
    if q.dim() != 2 or q.shape[dim] % 8:
        raise ValueError(f"cannot pack {tuple(q.shape)} along dim {dim}: need a multiple of 8")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("4-bit values must lie in 0..15")
    q = q.to(torch.int64).movedim(dim, -1)  # [..., L]
    groups = q.reshape(*q.shape[:-1], -1, 8)[..., list(order)]  # [..., L/8, 8] in nibble order
    shifts = 4 * torch.arange(8, dtype=torch.int64, device=q.device)
    packed = (groups << shifts).sum(-1)  # in int64, so bit 31 does not overflow
    return _to_int32(packed).movedim(-1, dim).contiguous()


def unpack_int4(
    packed: torch.Tensor, dim: int, order: tuple[int, ...] = IDENTITY_ORDER
) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 [.., L/8 along dim ..] -> int32 values 0..15."""
    p = packed.movedim(dim, -1)
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=packed.device)
    nibbles = (p.unsqueeze(-1) >> shifts) & 0xF  # [..., L/8, 8]: nibble i
    inverse = [order.index(c) for c in range(8)]  # nibble position of column c
    values = nibbles[..., inverse].reshape(*p.shape[:-1], -1)
    return values.movedim(-1, dim).contiguous()


def dequantize_gptq_reference(
    qweight: torch.Tensor,  # [K/8, N] int32
    qzeros: torch.Tensor,  # [G, N/8] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K] int
    zero_offset: int = 1,  # 1 for checkpoint_format gptq (zeros stored minus one), 0 for gptq_v2
) -> torch.Tensor:  # [N, K] float32
    """Plain dequantization of GPTQ-layout tensors, nibble by nibble (the test oracle)."""
    k_total, n_total = qweight.shape[0] * 8, qweight.shape[1]
    zeros = torch.empty(qzeros.shape[0], n_total, dtype=torch.int64)
    for i in range(8):  # nibble i of qzeros[:, j] is the zero of output column 8 * j + i
        zeros[:, i::8] = (qzeros.long() >> (4 * i)) & 0xF
    zeros += zero_offset
    w = torch.empty(n_total, k_total, dtype=torch.float32)
    for k in range(k_total):  # input row k is nibble k % 8 of qweight[k // 8]
        q = (qweight[k // 8].long() >> (4 * (k % 8))) & 0xF  # [N]
        g = int(g_idx[k])
        w[:, k] = (q - zeros[g]).float() * scales[g].float()
    return w


def dequantize_awq_reference(
    qweight: torch.Tensor,  # [K, N/8] int32
    qzeros: torch.Tensor,  # [G, N/8] int32
    scales: torch.Tensor,  # [G, N]
    group_size: int,
) -> torch.Tensor:  # [N, K] float32
    """Plain dequantization of AWQ-layout tensors, nibble by nibble (the test oracle)."""
    k_total, n_total = qweight.shape[0], qweight.shape[1] * 8
    q = torch.empty(k_total, n_total, dtype=torch.int64)
    zeros = torch.empty(qzeros.shape[0], n_total, dtype=torch.int64)
    for i in range(8):  # nibble i holds column AWQ_ORDER[i] of each group of eight
        q[:, AWQ_ORDER[i] :: 8] = (qweight.long() >> (4 * i)) & 0xF
        zeros[:, AWQ_ORDER[i] :: 8] = (qzeros.long() >> (4 * i)) & 0xF
    w = torch.empty(n_total, k_total, dtype=torch.float32)
    for k in range(k_total):
        g = k // group_size
        w[:, k] = (q[k] - zeros[g]).float() * scales[g].float()
    return w
