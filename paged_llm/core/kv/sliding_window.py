"""Sliding-window release for the paged policy (no torch): when every layer of a model attends
only to its last W positions, the blocks that fell wholly out of the window go back to the pool
as soon as they do, their block-table entries becoming NULL_BLOCK. ``PagedKVCacheManager``
attaches this after each step only for a windowed model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_llm.core.kv.base import NULL_BLOCK
from paged_llm.core.request import Request

if TYPE_CHECKING:
    from paged_llm.core.kv.paged import PagedKVCacheManager


class WindowRelease:
    """Frees each request's blocks behind its sliding window."""

    def __init__(self, kv: PagedKVCacheManager) -> None:
        if kv.sliding_window is None:
            raise ValueError("WindowRelease needs a manager with a sliding window")
        self.kv = kv
        self.window: int = kv.sliding_window

    def release(self, request: Request) -> None:
        """Free the blocks no later token can see: the next query sits at position
        num_computed_tokens or later and sees back to num_computed_tokens - W + 1. One more
        position is kept, so a sequence forked to recompute the last token (a parallel
        sample) still finds its whole window."""
        kv = self.kv
        table = kv.block_tables.get(request.request_id)
        if not table:
            return
        first_seen = max(0, request.num_computed_tokens - self.window)
        dead = min(len(table), first_seen // kv.block_size)
        start = kv._num_released.get(request.request_id, 0)
        if dead <= start:
            return
        kv.pool.release(table[start:dead][::-1])  # later blocks first, as in free()
        table[start:dead] = [NULL_BLOCK] * (dead - start)
        kv._num_released[request.request_id] = dead
