"""The readable reference backend: gather paged K/V with torch indexing, then attention."""

from __future__ import annotations

import torch

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.ops.kv_store.reference import store_kv_reference
from paged_llm.ops.paged_attention.reference import (
    paged_attention_reference,
    paged_decode_attention_batched,
)


class TorchAttentionBackend(AttentionBackend):
    """Plain torch: batched decode via padded gather, prefills one sequence at a time."""

    name = "torch"
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
    ) -> torch.Tensor:
        """Store K/V, then decode sequences in one batch and prefill sequences in a loop."""
        scales = (k_scale, v_scale)  # both None unless the cache is quantized
        store_kv_reference(key, value, k_cache, v_cache, meta.slot_mapping, *scales)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            out[:nd] = paged_decode_attention_batched(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                *scales,
            )  # fmt: skip
        if nd < meta.num_seqs:
            out[nd:] = paged_attention_reference(
                query[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.query_lens_cpu[nd:],
                meta.seq_lens_cpu[nd:],
                scale,
                *scales,
            )
        return out
