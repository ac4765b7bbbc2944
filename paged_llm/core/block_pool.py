"""The pool of physical KV blocks: an O(1) free list in LRU order, reference counts, and the
prefix cache's hash -> block map (no torch).

A block whose last reference drops goes to the back of the free list but keeps its hash, so a
later request with the same prefix can take it back; blocks are reused from the front, which
evicts the least recently freed cached blocks first.

A block table lists a request's block ids in logical order; a sliding window leaves NULL_BLOCK
where a freed block was.
"""

from __future__ import annotations

from collections.abc import Callable

# A block-table entry whose block fell out of the sliding window and went back to the pool.
# Such entries are a prefix of the table; kernels never read them (the runner writes block 0
# in their place). Keeping the entry keeps logical block i at table index i.
NULL_BLOCK = -1


def live_blocks(table: list[int]) -> list[int]:
    """The real block ids of a table (without the NULL_BLOCK entries of a sliding window)."""
    return [b for b in table if b != NULL_BLOCK]


class BlockPool:
    """Hands out block ids; a block returns to the free list when its last reference drops."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order = LRU
        self.ref_counts = [0] * num_blocks
        # prefix cache: block -> (hash, token ids) and hash -> block, for full blocks only
        self._block_key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._cached: dict[int, int] = {}
        self.num_evictions = 0
        # called as on_evict(block, hash, tokens) when a cached block is taken for other tokens,
        # before anything overwrites it (a CPU tier copies it out then; see core/kv/offload.py)
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None

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

    # ---- prefix cache -----------------------------------------------------------------------
    def register(self, block: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Record that ``block`` holds the KV of ``tokens`` under ``block_hash`` (KV written)."""
        if block_hash in self._cached or block in self._block_key:
            return  # an identical block is already cached, or this one already is
        self._cached[block_hash] = block
        self._block_key[block] = (block_hash, tokens)

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block for this hash whose stored tokens match (guards against collisions)."""
        b = self._cached.get(block_hash)
        if b is None or self._block_key[b][1] != tokens:
            return None
        return b

    def take_cached(self, block: int) -> None:
        """Add a reference to a cached block, pulling it off the free list if it was unused."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def is_cached(self, block: int) -> bool:
        """True when the block is registered in the prefix cache."""
        return block in self._block_key

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); refused (False) while any
        block is referenced, since a running request's blocks may be registered later."""
        if any(self.ref_counts):
            return False
        self.num_evictions += len(self._block_key)
        self._block_key.clear()
        self._cached.clear()
        return True

    def _evict(self, block: int) -> None:
        key = self._block_key.pop(block, None)
        if key is not None:
            del self._cached[key[0]]
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block, *key)
