"""``LoRALinear``: a base linear layer plus the LoRA deltas of up to ``max_loras`` adapters,
each token adding its own adapter's (multi-LoRA batching as in Punica and S-LoRA)."""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.ops.lora import add_lora, slot_groups


class LoRABatch:
    """The step's token -> adapter slot map, shared by every LoRALinear of a model; the LoRA
    manager sets it before each forward pass."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None  # [T] int64, -1 = no adapter; None: none
        self.groups: list[tuple[int, torch.Tensor | None]] | None = None  # CPU: rows per slot

    def set(self, token_slots: torch.Tensor | None) -> None:
        """This step's map (None: no token uses an adapter)."""
        self.token_slots = token_slots
        on_cpu = token_slots is not None and not token_slots.is_cuda
        self.groups = slot_groups(token_slots) if on_cpu else None


class LoRALinear(nn.Module):
    """``base(x) + B_s (A_s x)`` for each token's adapter slot ``s``; the base layer (float or
    quantized) is untouched, so adapters switch per request without merging weights."""

    def __init__(
        self, base: nn.Module, in_features: int, out_features: int, max_loras: int,
        max_rank: int, batch: LoRABatch, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.full_features = (in_features, out_features)  # what an adapter's A and B span
        self.batch = batch
        # Stacked per slot, rank padded with zeros (zero rows of A / columns of B add nothing).
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device),
            persistent=False,
        )  # fmt: skip  # [S, R, K]
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device),
            persistent=False,
        )  # fmt: skip  # [S, N, R]

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Copy one adapter's A [r, K] and B [N, r] into ``slot`` (None: zeros, the adapter
        does not touch this layer)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is not None and b is not None:
            a, b = self.shard(a, b)
            r = a.shape[0]
            self.lora_a[slot, :r].copy_(a)
            self.lora_b[slot, :, :r].copy_(b)

    def shard(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of an adapter's A [r, K_full] and B [N_full, r] this layer holds (all of
        it in one process; see lora/parallel.py for tensor-parallel layers)."""
        return a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        """The base layer's output plus each token's adapter delta."""
        return self.add_delta(self.base(x), x)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, N], [T, K]
        """``y`` plus each token's adapter delta (in place)."""
        slots = self.batch.token_slots
        if slots is None:
            return y
        return add_lora(y, x, self.lora_a, self.lora_b, slots, self.batch.groups)

    def extra_repr(self) -> str:
        s, r, _ = self.lora_a.shape
        return f"in={self.in_features}, out={self.out_features}, max_loras={s}, max_rank={r}"
