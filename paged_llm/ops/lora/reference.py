"""Torch reference for batched multi-LoRA (Punica / S-LoRA "BGMV"): each token adds the low-rank
update of its own adapter to the base layer's output.

Adapters live in ``S`` slots of two stacked weight tensors, their ranks padded to a common ``R``
with zeros (zero rows of A / columns of B add nothing), and the LoRA scaling ``alpha / r`` is
already folded into B. Token t with slot ``s = token_slots[t] >= 0`` gets
``y[t] += (x[t] @ A[s].T) @ B[s].T``; slot -1 (a request without an adapter) leaves its row alone.

The update is computed in float32 and added to y in float32, rounding to y's dtype once (the
Triton kernels round the same way, so the two differ only by the order of their sums). Looping
over the adapters present and doing two GEMMs each is also the fast path for prefill on the CPU.
"""

from __future__ import annotations

import torch


def check_lora_args(
    y: torch.Tensor,  # [T, N]
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int
) -> None:
    """Raise a ValueError naming ``add_lora`` unless the arguments fit its contract."""
    if y.dim() != 2 or not y.is_floating_point():
        raise ValueError(f"add_lora: y must be a floating [T, N] tensor, got {_desc(y)}")
    t, n = y.shape
    if x.dim() != 2 or x.shape[0] != t or not x.is_floating_point():
        raise ValueError(f"add_lora: x must be a floating [T={t}, K] tensor, got {_desc(x)}")
    k = x.shape[1]
    if lora_a.dim() != 3 or lora_a.shape[2] != k or not lora_a.is_floating_point():
        raise ValueError(
            f"add_lora: lora_a must be a floating [S, R, K={k}] tensor, got {_desc(lora_a)}"
        )
    s, r, _ = lora_a.shape
    if lora_b.shape != (s, n, r) or not lora_b.is_floating_point():
        raise ValueError(
            f"add_lora: lora_b must be a floating [S={s}, N={n}, R={r}] tensor, got {_desc(lora_b)}"
        )
    if token_slots.shape != (t,) or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"add_lora: token_slots must be an int32/int64 [T={t}] tensor, got {_desc(token_slots)}"
        )
    devices = {tensor.device for tensor in (y, x, lora_a, lora_b, token_slots)}
    if len(devices) != 1:
        raise ValueError(
            f"add_lora: all tensors must be on one device, got {sorted(map(str, devices))}"
        )


def _desc(tensor: torch.Tensor) -> str:
    """Shape and dtype of a tensor, for error messages."""
    return f"{list(tensor.shape)} {tensor.dtype}"


def slot_groups(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """(slot, rows [T_s] int64) for each adapter slot present; rows is None when every token
    uses that slot (no gather needed). Computed once per step, shared by every layer."""
    slots = torch.unique(token_slots).tolist()
    if len(slots) == 1:
        return [] if slots[0] < 0 else [(slots[0], None)]
    return [(s, (token_slots == s).nonzero().squeeze(1)) for s in slots if s >= 0]


def add_lora_reference(
    y: torch.Tensor,  # [T, N] base layer output, updated in place
    x: torch.Tensor,  # [T, K] layer input
    lora_a: torch.Tensor,  # [S, R, K] A of each adapter slot (rank padded with zero rows)
    lora_b: torch.Tensor,  # [S, N, R] B of each slot, scaling folded in (padded columns zero)
    token_slots: torch.Tensor,  # [T] int slot of each token's adapter, -1 = none
    groups: list[tuple[int, torch.Tensor | None]] | None = None,  # slot_groups(token_slots)
) -> torch.Tensor:
    """Add ``(x[t] @ lora_a[s].T) @ lora_b[s].T`` to ``y[t]`` for each token's slot s; return y."""
    check_lora_args(y, x, lora_a, lora_b, token_slots)
    for slot, rows in slot_groups(token_slots) if groups is None else groups:
        xs = x if rows is None else x.index_select(0, rows)
        delta = (xs.float() @ lora_a[slot].float().T) @ lora_b[slot].float().T  # [T_s, N]
        if y.dtype == torch.float32:  # adding float32 to float32 is the one rounding already
            y.add_(delta) if rows is None else y.index_add_(0, rows, delta)
        elif rows is None:
            y.copy_(y.float() + delta)
        else:  # one rounding: y + delta in float32, then y's dtype (what the kernels store)
            y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
    return y
