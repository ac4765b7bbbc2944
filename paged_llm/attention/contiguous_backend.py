"""The layout of the systems the paper compares against: each sequence's K/V is one contiguous
run of slots, read as a plain slice (no block-table gather). Needs a reservation policy
(orca_*/static), whose buddy allocator hands each request one contiguous run."""

from __future__ import annotations

import torch

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.ops.kv_store.reference import store_kv_reference
from paged_llm.ops.paged_attention.reference import attention_one_sequence


class ContiguousAttentionBackend(AttentionBackend):
    """Per-sequence contiguous caches: K/V of sequence b is ``flat[start_b : start_b + len_b]``."""

    name = "contiguous"
    requires_contiguous_blocks = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store K/V, then attend over each sequence's contiguous slice of the pool."""
        store_kv_reference(key, value, k_cache, v_cache, meta.slot_mapping)
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        starts = (meta.block_tables[:, 0].long() * block_size).tolist()
        out = torch.empty_like(query)
        q_start = 0
        for start, q_len, s_len in zip(starts, meta.query_lens_cpu, meta.seq_lens_cpu):
            k = flat_k[start : start + s_len].to(query.dtype)
            v = flat_v[start : start + s_len].to(query.dtype)
            out[q_start : q_start + q_len] = attention_one_sequence(
                query[q_start : q_start + q_len], k, v, scale
            )
            q_start += q_len
        return out
