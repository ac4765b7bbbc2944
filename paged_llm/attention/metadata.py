"""Per-step attention metadata: how the flat token batch maps onto sequences and KV slots (the
metadata of sequences in a drafter's own order is spec/any_order.py's)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from paged_llm.runner.batch import int_tensor, padded_int_rows, to_device


@dataclass
class AttentionMetadata:
    """Describes one engine step's flattened batch of T tokens from B sequences.

    Sequences are ordered decodes first (query length 1), then prefills/chunks (the runner
    sorts them shortest first), so backends can send the first ``num_decodes`` sequences to a
    decode kernel.
    Query token j of sequence b sits at position ``seq_lens[b] - query_len[b] + j`` and attends
    causally to every context position <= its own (the prefix is already in the paged cache).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat slot (block_id * block_size + offset); -1 = skip
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have query length 1
    query_lens_cpu: list[int]  # [B] host copies, so reference paths avoid device syncs
    seq_lens_cpu: list[int]  # [B]
    # A mixed-step CUDA graph's batch: rows of T past query_start_loc[-1] are padding, which
    # no sequence owns; backends leave their output zero (finite for the layers after).
    padded_tokens: bool = False
    # Filled on first use by ``context_blocks`` (backends that gather per sequence) and then
    # shared by every layer of the step: each sequence's context blocks, concatenated
    # ([sum_b ceil(seq_lens[b] / block_size)] int64), and where its run starts ([B + 1]).
    context_block_ids: torch.Tensor | None = field(default=None, repr=False)
    context_block_starts: list[int] | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        """Number of sequences B in the step."""
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """Number of query tokens T in the step."""
        return int(sum(self.query_lens_cpu))


def slot_mapping(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[int]:  # [T]
    """The KV slot of every query token: each sequence's last query_len positions."""
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        if q_len > s_len:
            raise ValueError(f"query length {q_len} exceeds sequence length {s_len}")
        if len(table) * block_size < s_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


def query_starts(query_lens: list[int]) -> list[int]:  # [B + 1]
    """Cumulative query lengths: where each sequence's tokens start in the flat batch."""
    return [0, *itertools.accumulate(query_lens)]


def padded_block_tables(tables: list[list[int]], width: int = 0) -> torch.Tensor:
    """Block tables as the kernels read them, zero-padded to ``width`` or to the widest of
    them: a CPU int64 tensor [B, W]. Entries freed by a sliding window (NULL_BLOCK, the only
    negative id) become block 0, a valid id that the window keeps the kernels from reading."""
    return padded_int_rows(tables, width).clamp_min_(0)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from host lists (sequences must already be ordered decodes first)."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    slots = slot_mapping(query_lens, seq_lens, block_tables, block_size)
    num_decodes = 0
    for q_len in query_lens:
        if q_len != 1:
            break
        num_decodes += 1
    padded = padded_block_tables(block_tables)  # [B, max_blocks]
    max_blocks = padded.shape[1]
    starts = query_starts(query_lens)
    # One host-to-device copy for all four, through pinned memory (a copy from pageable
    # memory waits for the stream), then int32 casts on the device.
    flat = torch.cat([int_tensor(slots + starts + list(seq_lens)), padded.view(-1)])
    sizes = [len(slots), len(starts), len(seq_lens), padded.numel()]
    slot_t, starts_t, lens_t, tables_t = to_device(flat, device).split(sizes)
    return AttentionMetadata(
        slot_mapping=slot_t,
        query_start_loc=starts_t.to(torch.int32),
        seq_lens=lens_t.to(torch.int32),
        block_tables=tables_t.to(torch.int32).view(len(block_tables), max_blocks),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_decodes=num_decodes,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def context_blocks(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, list[int]]:
    """(concatenated context block ids [N] int64, per-sequence starts [B + 1]) of a step,
    computed from the block tables on the first call (a device-to-host copy on GPUs) and kept
    on ``meta`` for the step's other layers."""
    if meta.context_block_ids is None or meta.context_block_starts is None:
        ids, starts = [], [0]
        for s_len, table in zip(meta.seq_lens_cpu, meta.block_tables.tolist()):
            ids.extend(table[: -(-s_len // block_size)])
            starts.append(len(ids))
        meta.context_block_ids = torch.tensor(
            ids, dtype=torch.int64, device=meta.block_tables.device
        )
        meta.context_block_starts = starts
    return meta.context_block_ids, meta.context_block_starts
