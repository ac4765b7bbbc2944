"""A buddy allocator over block ids: contiguous power-of-two runs, as the paper's Orca
baselines used, so external fragmentation is real (no torch)."""

from __future__ import annotations


def ceil_log2(n: int) -> int:
    """Smallest k with 2**k >= n (n >= 1)."""
    return max(0, (n - 1).bit_length())


class BuddyAllocator:
    """Allocates aligned runs of 2**k blocks from ``num_blocks``, runs at most 2**max_order."""

    def __init__(self, num_blocks: int, max_order: int) -> None:
        if num_blocks < 1:
            raise ValueError("the buddy allocator needs at least one block")
        self.num_blocks = num_blocks
        self.max_order = max_order
        self._free: list[set[int]] = [set() for _ in range(max_order + 1)]
        self._allocated: dict[int, int] = {}  # start -> order
        # Carve the pool into aligned top-level runs of decreasing size (983 = 7x128 + 64 + ...).
        start = 0
        for order in range(max_order, -1, -1):
            while num_blocks - start >= (1 << order):
                self._free[order].add(start)
                start += 1 << order
        # the largest run the empty pool offers: 2**max_order only if the pool holds one
        self.max_run = 1 << min(max_order, num_blocks.bit_length() - 1)

    @property
    def num_free_blocks(self) -> int:
        """Blocks in free runs."""
        return sum(len(s) << k for k, s in enumerate(self._free))

    def largest_free_run(self) -> int:
        """Size in blocks of the largest run that could be allocated now."""
        for k in range(self.max_order, -1, -1):
            if self._free[k]:
                return 1 << k
        return 0

    def can_allocate(self, n: int) -> bool:
        """True when a run of at least ``n`` blocks is free."""
        k = ceil_log2(n)
        return k <= self.max_order and any(self._free[j] for j in range(k, self.max_order + 1))

    def allocate(self, n: int) -> tuple[int, int] | None:
        """Return (start, run_length) of a free aligned run >= n blocks, or None."""
        k = ceil_log2(n)
        if k > self.max_order:
            return None
        j = next((j for j in range(k, self.max_order + 1) if self._free[j]), None)
        if j is None:
            return None
        start = min(self._free[j])  # lowest address first keeps allocation deterministic
        self._free[j].remove(start)
        while j > k:  # split, keeping the lower half
            j -= 1
            self._free[j].add(start + (1 << j))
        self._allocated[start] = k
        return start, 1 << k

    def free(self, start: int) -> None:
        """Return the run that starts at ``start``, merging with free buddies."""
        k = self._allocated.pop(start)
        while k < self.max_order:
            buddy = start ^ (1 << k)
            if buddy not in self._free[k]:
                break
            self._free[k].remove(buddy)
            start = min(start, buddy)
            k += 1
        self._free[k].add(start)
