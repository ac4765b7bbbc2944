"""The fast CPU backend: the torch backend with decodes through a native C++ kernel that reads
K/V straight out of the paged cache (``ops/paged_attention/cpu_decode.cpp``).

Short multi-token queries (a speculative verification's k + 1 tokens, a draft model catching
up) go through the same kernel: with the step's K/V already stored, query token j of a sequence
with q new tokens and context length L is a decode over the first L - q + 1 + j positions, so
each such token becomes one kernel row reading its sequence's block table.
"""

from __future__ import annotations

import torch

from paged_llm.attention.metadata import AttentionMetadata
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.ops.paged_attention import cpu_native


class CpuAttentionBackend(TorchAttentionBackend):
    """Decodes (one query token per sequence, the bulk of a serving step) and short multi-token
    queries run in one native call per layer, parallel over rows, with no gathered copy of the
    context, from a float or a quantized (int8 / fp8 + scales) cache; prefills and chunks take
    the torch backend's gather + SDPA path."""

    name = "cpu"
    # Kernel rows each read their whole context; gather + SDPA reads it once for all of a
    # sequence's queries in one matmul, after a fixed cost per sequence. Timed by `python -m
    # experiments.cpu_attention --query-len ...` (docs/benchmarks.md): rows were faster for up
    # to 4 query tokens at every context (64-1024) and while query tokens x context <= 2048.
    rows_always_query_len = 4
    rows_max_query_context = 2048

    def __init__(self) -> None:
        super().__init__()
        # The kernel rows of the last step's metadata, shared by its layers: (meta, sequences
        # covered, block tables [R, max_blocks] int32, context lengths [R] int32, rows R).
        self._rows: tuple[AttentionMetadata, int, torch.Tensor, torch.Tensor, int] | None = None

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
        out: torch.Tensor,  # [T, Hq, D]: the rows of the sequences done are written in place
        k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv]: quantized cache
        v_scale: torch.Tensor | None,
        sliding_window: int | None = None,
    ) -> int:
        """The leading decodes and short queries (``as_rows``) in one kernel call, one row per
        token; returns how many sequences it did."""
        num, tables, lens, rows = self._kernel_rows(meta)
        if num == 0:
            return 0
        cpu_native.paged_decode_cpu(
            out[:rows], query[:rows].contiguous(), k_cache, v_cache, tables, lens, scale,
            k_scale, v_scale, sliding_window,
        )  # fmt: skip
        return num

    def as_rows(self, query_len: int, seq_len: int) -> bool:
        """Whether a sequence's queries run as kernel rows (else gather + SDPA)."""
        return (
            query_len <= self.rows_always_query_len
            or query_len * seq_len <= self.rows_max_query_context
        )

    def _kernel_rows(self, meta: AttentionMetadata) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """(sequences, block tables [R, max_blocks], context lengths [R], rows R) of the
        leading short queries, built once per step."""
        if self._rows is not None and self._rows[0] is meta:
            return self._rows[1:]
        q_lens = meta.query_lens_cpu
        num = meta.num_decodes
        while num < meta.num_seqs and self.as_rows(q_lens[num], meta.seq_lens_cpu[num]):
            num += 1
        if num == meta.num_decodes:  # decodes only: one row per sequence as it is
            tables, lens, rows = meta.block_tables, meta.seq_lens, num
        else:
            lens_cpu = [s - q + 1 + j for q, s in zip(q_lens[:num], meta.seq_lens_cpu[:num])
                        for j in range(q)]  # fmt: skip
            repeats = torch.tensor(q_lens[:num], device=meta.block_tables.device)
            tables = meta.block_tables[:num].repeat_interleave(repeats, dim=0)
            lens = torch.tensor(lens_cpu, dtype=torch.int32, device=meta.seq_lens.device)
            rows = len(lens_cpu)
        self._rows = (meta, num, tables, lens, rows)
        return num, tables, lens, rows
