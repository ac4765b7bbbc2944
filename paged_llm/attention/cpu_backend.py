"""The fast CPU backend: the torch backend with decodes through a native C++ kernel that reads
K/V straight out of the paged cache (``ops/paged_attention/cpu_decode.cpp``)."""

from __future__ import annotations

import torch

from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.ops.paged_attention import cpu_native


class CpuAttentionBackend(TorchAttentionBackend):
    """Decodes (one query token per sequence, the bulk of a serving step) run in one native call
    per layer, parallel over sequences, with no gathered copy of the context, from a float or
    a quantized (int8 / fp8 + scales) cache; prefills and chunks take the torch backend's
    gather + SDPA path."""

    name = "cpu"

    def check_device(self, device: torch.device) -> None:
        """Allow only the CPU, and build the kernel now so a missing compiler fails early."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not '{device}'")
        cpu_native.load()

    def _decodes(
        self,
        query: torch.Tensor,  # [T, Hq, D]: the step's queries, decodes first
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], any cache dtype
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D]: the decodes' rows are written in place
        k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv]: quantized cache
        v_scale: torch.Tensor | None,
        sliding_window: int | None = None,
    ) -> int:
        """All decoding sequences' attention in one kernel call; returns how many it did."""
        num = meta.num_decodes
        if num == 0:
            return 0
        decodes = out[:num]  # contiguous rows of a fresh contiguous tensor
        cpu_native.paged_decode_cpu(
            decodes, query[:num].contiguous(), k_cache, v_cache, meta.block_tables,
            meta.seq_lens, scale, k_scale, v_scale, sliding_window,
        )  # fmt: skip
        return num
