"""The attention layer every model uses: projections stay in the model; this layer only hands
q/k/v to the step's backend together with its own layer's slice of the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.utils.checks import check_window


@dataclass
class ForwardContext:
    """Everything a forward pass needs beyond token ids and positions (one per engine step)."""

    attn_metadata: AttentionMetadata
    backend: AttentionBackend
    # kv_caches[layer] = (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # kv_scales[layer] = (k_scale, v_scale) [num_blocks, block_size, Hkv]: int8 / fp8 cache only
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None


class PagedAttention(nn.Module):
    """Multi-head / grouped-query attention over the paged cache of layer ``layer_idx``
    (with ``sliding_window=W``, each token sees only its last W positions)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_idx: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} not divisible by num_kv_heads={num_kv_heads}")
        check_window(sliding_window)
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq * D]
        k: torch.Tensor,  # [T, Hkv * D]
        v: torch.Tensor,  # [T, Hkv * D]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, Hq * D]
        """Store this step's K/V in the cache and attend over each sequence's context."""
        t = q.shape[0]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        # Scales only travel with a quantized cache, and a window only with a windowed layer.
        extra = {}
        if ctx.kv_scales:
            k_scale, v_scale = ctx.kv_scales[self.layer_idx]
            extra = {"k_scale": k_scale, "v_scale": v_scale}
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        out = ctx.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            k_cache,
            v_cache,
            ctx.attn_metadata,
            self.scale,
            **extra,
        )
        return out.reshape(t, self.num_heads * self.head_dim)
