"""The fast CPU backend: the torch backend with decodes through a native C++ kernel that reads
K/V straight out of the paged cache (``ops/paged_attention/cpu_decode.cpp``)."""

from __future__ import annotations

import torch

from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.ops.paged_attention import cpu_native


class CpuAttentionBackend(TorchAttentionBackend):
    """Decodes (one query token per sequence, the bulk of a serving step) run in one native call
    per layer, parallel over sequences, with no gathered copy of the context; prefills, chunks
    and quantized caches take the torch backend's gather + SDPA path."""

    name = "cpu"

    def check_device(self, device: torch.device) -> None:
        """Allow only the CPU, and build the kernel now so a missing compiler fails early."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not '{device}'")
        cpu_native.load()

    def _decodes(
        self,
        query: torch.Tensor,  # [Bd, Hq, D]: one query token per decoding sequence
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], unquantized
        v_cache: torch.Tensor,
        ids: torch.Tensor,  # unused: the kernel reads the block tables itself
        block_starts: list[int],
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [Bd, Hq, D], written in place
    ) -> None:
        """All decoding sequences' attention in one kernel call (decodes come first in meta)."""
        if query.shape[0] == 0:
            return
        target = (
            out
            if out.is_contiguous()
            else torch.empty_like(query, memory_format=torch.contiguous_format)
        )
        cpu_native.paged_decode_cpu(
            target, query.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
        )
        if target is not out:
            out.copy_(target)
