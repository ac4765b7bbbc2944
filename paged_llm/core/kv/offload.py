"""A second, larger tier for the prefix cache in CPU memory (vLLM's ``kv_offloading_size``; what
LMCache does for vLLM): a cached device block that is about to be reused for other tokens is
first copied here, and a later request whose prefix hashes to it copies it back instead of
computing it again (no torch).

The tier is an LRU cache of full blocks keyed by the same chained hash as the device prefix
cache. It reuses :class:`BlockPool`: a block is taken (evicting the least recently used entry),
registered and released at once, so every entry sits on the pool's free list in LRU order and a
lookup that hits moves it to the back.
"""

from __future__ import annotations

from paged_llm.core.block_pool import BlockPool


class PrefixOffloadTier:
    """Offloaded prefix blocks: hash -> CPU block, least recently used evicted first."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.num_saved = 0  # device blocks copied here
        self.num_loaded = 0  # blocks copied back to the device (offload hits)

    @property
    def num_blocks(self) -> int:
        """The tier's size in blocks."""
        return self.pool.num_blocks

    def save(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """A CPU block to copy an evicted device block into, registered under its hash; None
        when the tier holds these tokens already (it only becomes the most recent entry)."""
        if self.find(block_hash, tokens) is not None or self.pool.num_free == 0:
            return None  # already here, or every entry is being loaded right now (pinned)
        (cpu,) = self.pool.allocate(1)  # evicts the least recently used entry
        self.pool.register(cpu, block_hash, tokens)
        self.pool.release([cpu])  # unreferenced: on the free list, most recent last
        self.num_saved += 1
        return cpu

    def find(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The CPU block holding these tokens (now the most recently used), or None."""
        cpu = self.pool.lookup(block_hash, tokens)
        if cpu is not None:
            self.pool.take_cached(cpu)
            self.pool.release([cpu])
        return cpu

    def pin(self, blocks: list[int]) -> None:
        """Keep these entries from eviction while their copies to the device are decided."""
        for b in blocks:
            self.pool.take_cached(b)

    def unpin(self, blocks: list[int]) -> None:
        """Undo ``pin``; the entries go back to the LRU order as the most recent."""
        self.pool.release(blocks)

    def reset(self) -> None:
        """Forget every entry (the KV came from weights that changed)."""
        self.pool.reset_prefix_cache()
