"""The layout of the systems the paper compares against: each sequence's K/V is one contiguous
run of slots, read as a plain slice (no block-table gather). Needs a reservation policy
(orca_*/static), whose buddy allocator hands each request one contiguous run."""

from __future__ import annotations

import torch

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.attention.torch_backend import store_kv_reference, window_start
from paged_llm.ops.paged_attention.reference import attention_one_sequence
from paged_llm.quant.kv_cache import KVCacheSpec


class ContiguousAttentionBackend(AttentionBackend):
    """Per-sequence contiguous caches: K/V of sequence b is ``flat[start_b : start_b + len_b]``."""

    name = "contiguous"
    requires_contiguous_blocks = True
    supports_quantized_kv = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store K/V, then attend over each sequence's contiguous slice of the pool."""
        store_kv_reference(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        if k_scale is not None:  # quantized cache: one scale per (slot, head)
            flat_ks = k_scale.view(-1, k_scale.shape[-1])  # [num_slots, Hkv]
            flat_vs = v_scale.view(-1, v_scale.shape[-1])
        starts = (meta.block_tables[:, 0].long() * block_size).tolist()
        out = torch.empty_like(query)
        q_start = 0
        for start, q_len, s_len in zip(starts, meta.query_lens_cpu, meta.seq_lens_cpu):
            # Read from the first position inside the first query's window (0 without one).
            lo, hi = start + window_start(s_len, s_len - q_len, sliding_window), start + s_len
            k, v = flat_k[lo:hi], flat_v[lo:hi]
            if k_scale is not None:
                k = KVCacheSpec.dequantize(k, flat_ks[lo:hi], query.dtype)
                v = KVCacheSpec.dequantize(v, flat_vs[lo:hi], query.dtype)
            k, v = k.to(query.dtype), v.to(query.dtype)
            out[q_start : q_start + q_len] = attention_one_sequence(
                query[q_start : q_start + q_len], k, v, scale, sliding_window
            )
            q_start += q_len
        return out
