"""The pool of physical KV blocks: an O(1) free list plus reference counts (no torch)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids; a block returns to the free list when its last reference drops."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks no request references."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each); raise if there are fewer."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} blocks but only {len(self._free)} are free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
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
                self._free.append(b)
