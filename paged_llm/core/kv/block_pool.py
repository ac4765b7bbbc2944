"""The pool of physical KV blocks with the prefix cache's index (no torch): the allocator's
free list and reference counts (``BlockAllocator``, core/kv/base.py), plus which full block
holds which tokens, by hash.

A block whose last reference drops goes to the back of the free list but keeps its hash, so a
later request with the same prefix can take it back; blocks are reused from the front, which
evicts the least recently freed cached blocks first. The paged policy uses this pool only with
prefix caching or a KV connector; otherwise the plain ``BlockAllocator``.
"""

from __future__ import annotations

from collections.abc import Callable

from paged_llm.core.kv.base import NULL_BLOCK, BlockAllocator, live_blocks

__all__ = ["NULL_BLOCK", "BlockPool", "live_blocks"]  # the table helpers: re-exported


class BlockPool(BlockAllocator):
    """A block allocator that remembers what freed blocks hold, so a prefix can be found again."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        # prefix cache: block -> (hash, token ids) and hash -> block, for full blocks only
        self._block_key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._cached: dict[int, int] = {}
        self.num_evictions = 0
        # called as on_evict(block, hash, tokens) when a cached block is taken for other tokens,
        # before anything overwrites it (a CPU tier copies it out then; see core/kv/offload.py)
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None

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
        if not super().reset_prefix_cache():
            return False
        self.num_evictions += len(self._block_key)
        self._block_key.clear()
        self._cached.clear()
        return True

    def _evict(self, block: int) -> None:
        """Unregister a block taken from the free list for other tokens (offered to on_evict
        first)."""
        key = self._block_key.pop(block, None)
        if key is not None:
            del self._cached[key[0]]
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block, *key)
