"""Physical KV blocks handed out and taken back (no torch): an O(1) free list in LRU order and
reference counts, so blocks can be shared (forked sequences, cached prefixes).

A block table lists a request's block ids in logical order; a sliding window leaves NULL_BLOCK
where a freed block was. The prefix cache's index of which block holds which tokens is
``BlockPool``'s (core/block_pool.py), which extends this allocator.
"""

from __future__ import annotations

# A block-table entry whose block fell out of the sliding window and went back to the pool.
# Such entries are a prefix of the table; kernels never read them (the runner writes block 0
# in their place). Keeping the entry keeps logical block i at table index i.
NULL_BLOCK = -1


def live_blocks(table: list[int]) -> list[int]:
    """The real block ids of a table (without the NULL_BLOCK entries of a sliding window)."""
    return [b for b in table if b != NULL_BLOCK]


class BlockAllocator:
    """Hands out block ids; a block returns to the free list when its last reference drops."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order = LRU
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks no request references (cached or not)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), evicting their cached contents."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} blocks but only {len(self._free)} are free")
        blocks = []
        for _ in range(n):
            b = next(iter(self._free))
            del self._free[b]
            self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one reference to each block (a new owner shares it)."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"cannot share free block {b}")
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks left unreferenced become free."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} released more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def reset_prefix_cache(self) -> bool:
        """Nothing is cached here: refused (False) only while a block is referenced, as
        ``BlockPool``'s is."""
        return not any(self.ref_counts)

    def _evict(self, block: int) -> None:
        """Forget what a block taken from the free list held (nothing, without a cache)."""
