"""The readable reference backend: gather paged K/V with torch indexing, then attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata, context_blocks
from paged_llm.ops.kv_store.reference import store_kv_reference
from paged_llm.ops.paged_attention.reference import gather_blocks


class TorchAttentionBackend(AttentionBackend):
    """Plain torch: gather each sequence's blocks, then fused attention (the CPU default)."""

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
        """Store K/V, then per sequence: gather its blocks, one fused SDPA call."""
        scales = (k_scale, v_scale)  # both None unless the cache is quantized
        store_kv_reference(key, value, k_cache, v_cache, meta.slot_mapping, *scales)
        # The step's block ids are built once (one int64 tensor for all sequences, shared by
        # every layer), so each sequence's gather is one index_select on a slice of it.
        # Gathering all sequences at once was measured slower on a CPU: the gathered context
        # falls out of cache before SDPA reads it (docs/benchmarks.md).
        ids, block_starts = context_blocks(meta, k_cache.shape[1])
        out = torch.empty_like(query)
        start = 0
        for b, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            seq_ids = ids[block_starts[b] : block_starts[b + 1]]
            k = gather_blocks(k_cache, seq_ids, s_len, k_scale, query.dtype)
            v = gather_blocks(v_cache, seq_ids, s_len, v_scale, query.dtype)
            out[start : start + q_len] = sdpa_one_sequence(
                query[start : start + q_len], k, v, scale
            )
            start += q_len
        return out


def sdpa_one_sequence(
    q: torch.Tensor,  # [Lq, Hq, D]: the last Lq of the Lk positions
    k: torch.Tensor,  # [Lk, Hkv, D]
    v: torch.Tensor,  # [Lk, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [Lq, Hq, D]
    """``attention_one_sequence`` through torch's fused scaled_dot_product_attention (decode
    queries through two batched matmuls, see ``decode_one_sequence``).

    A per-sequence gather of exactly its blocks plus one fused call is several times faster on
    a CPU than a padded batched gather with einsums (docs/benchmarks.md has the profile).
    """
    lq, lk = q.shape[0], k.shape[0]
    if lq == 1:
        return decode_one_sequence(q, k, v, scale)
    q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]  # causal, aligned to the end
    mask = torch.arange(lk, device=q.device)[None, :] <= q_pos
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return o.transpose(0, 1)


def decode_one_sequence(
    q: torch.Tensor,  # [1, Hq, D]
    k: torch.Tensor,  # [Lk, Hkv, D]
    v: torch.Tensor,  # [Lk, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [1, Hq, D]
    """One query token's attention as scores = q K^T per KV head (its query-head group as the
    rows), softmax in float32, then p V. On a CPU this is ~1.4x faster than
    scaled_dot_product_attention for one query (measured in docs/benchmarks.md)."""
    hq, d = q.shape[1:]
    hkv = k.shape[1]
    scores = torch.bmm(q.view(hkv, hq // hkv, d), k.permute(1, 2, 0))  # [Hkv, G, Lk]
    p = torch.softmax(scores.float() * scale, dim=-1).to(v.dtype)
    return torch.bmm(p, v.transpose(0, 1)).reshape(1, hq, d)  # [Hkv, G, D] -> [1, Hq, D]
