"""The Triton backend: the same contract as the torch backend, run as fused GPU kernels."""

from __future__ import annotations

import os

import torch

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.ops.kv_store.triton import store_kv_triton
from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton
from paged_llm.ops.paged_attention.triton_prefill import paged_prefill_attention_triton


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels: KV store, split-K decode for decodes, varlen causal prefill for the rest."""

    name = "triton"
    supports_quantized_kv = True
    # Decode reads only device tensors and host values fixed at capture (max_seq_len).
    cuda_graph_safe = True

    def check_device(self, device: torch.device) -> None:
        """Allow CUDA; allow the CPU only through Triton's interpreter (``TRITON_INTERPRET=1``)."""
        device = torch.device(device)
        if device.type == "cuda":
            return
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return
        raise ValueError(
            f"the triton attention backend needs a CUDA GPU, not '{device}': use the torch "
            "attention backend instead, or set TRITON_INTERPRET=1 (before importing paged_llm) "
            "to run the Triton kernels in the slow CPU interpreter"
        )

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv]: int8 / fp8 cache
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store K/V, then attend: decode kernel for the decodes, prefill kernel for the rest."""
        scales = {"k_scale": k_scale, "v_scale": v_scale}  # None unless the cache is quantized
        store_kv_triton(key, value, k_cache, v_cache, meta.slot_mapping, **scales)
        # A mixed-step graph's padding rows belong to no sequence and are never written: zeros
        # keep them finite through the layers after (which work row by row).
        out = torch.zeros_like(query) if meta.padded_tokens else torch.empty_like(query)
        nd = meta.num_decodes  # decodes come first, one token each, so they own rows [0, nd)
        if nd:
            paged_decode_attention_triton(
                query[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                max_seq_len=meta.max_seq_len,
                out=out[:nd],
                sliding_window=sliding_window,
                **scales,
            )
        if nd < meta.num_seqs:
            # The prefill kernel indexes its own slice of tokens, so rebase the offsets by the
            # nd decode tokens in front (a tiny device op; no host sync).
            paged_prefill_attention_triton(
                query[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.query_start_loc[nd:] - nd,
                meta.seq_lens[nd:],
                scale,
                out=out[nd:],
                sliding_window=sliding_window,
                **scales,
            )
        return out
