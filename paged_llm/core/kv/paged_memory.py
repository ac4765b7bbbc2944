"""The paper's Fig. 2 split of a paged KV pool (no torch): token states, unfilled slots in
allocated blocks, and free blocks. Only runs where a step's memory is tracked (the
simulators' figures), so it lives beside the paged policy, not in its step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from paged_llm.core.kv.base import NULL_BLOCK, MemoryBreakdown
from paged_llm.core.request import Request

if TYPE_CHECKING:
    from paged_llm.core.kv.paged import PagedKVCacheManager


def paged_memory_breakdown(kv: PagedKVCacheManager, requests: Iterable[Request]) -> MemoryBreakdown:
    """Token states vs. unfilled slots in allocated blocks vs. free blocks.

    A block shared by several requests counts once, with the most tokens any owner keeps
    in it, so sharing shows up as saved memory rather than as double counting.
    """
    bs = kv.block_size
    if not kv._sharing:  # every block has one owner: no need to deduplicate
        allocated = token_states = 0
        for req in requests:
            released = kv._num_released.get(req.request_id, 0)  # out of the window
            slots = (len(kv.block_tables.get(req.request_id, ())) - released) * bs
            allocated += slots
            token_states += min(req.num_tokens - released * bs, slots)
        return MemoryBreakdown(token_states, 0, allocated - token_states, kv.num_slots - allocated)
    filled: dict[int, int] = {}
    for req in requests:
        table = kv.block_tables.get(req.request_id, ())
        for i, b in enumerate(table):
            if b == NULL_BLOCK:
                continue
            used = min(bs, max(0, req.num_tokens - i * bs))
            filled[b] = max(filled.get(b, 0), used)
    allocated = len(filled) * bs
    token_states = sum(filled.values())
    return MemoryBreakdown(
        token_states=token_states,
        reservation=0,
        internal_fragmentation=allocated - token_states,
        external_fragmentation=kv.num_slots - allocated,
    )
