"""A second, larger tier for the prefix cache in CPU memory (vLLM's ``kv_offloading_size``; what
LMCache does for vLLM): a cached device block that is about to be reused for other tokens is
first copied here, and a later request whose prefix hashes to it copies it back instead of
computing it again (no torch).

The tier is an LRU cache of full blocks keyed by the same chained hash as the device prefix
cache. It reuses :class:`BlockPool`: a block is taken (evicting the least recently used entry),
registered and released at once, so every entry sits on the pool's free list in LRU order and a
lookup that hits moves it to the back. ``OffloadedPrefixes`` connects the tier to the paged
manager's device pool.
"""

from __future__ import annotations

from collections.abc import Callable

from paged_llm.core.kv.block_pool import BlockPool


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


class OffloadedPrefixes:
    """The paged manager's use of the CPU tier: copies cached device blocks out as the device
    pool evicts them, finds a prompt's blocks in the tier, and loads hits into fresh device
    blocks. Copies are logged as the step's ("offload" | "onload", [(src, dst)]) block moves."""

    def __init__(
        self,
        tier: PrefixOffloadTier,
        pool: BlockPool,
        log: Callable[[str, list[tuple[int, int]]], None],
    ) -> None:
        self.tier, self.pool, self.log = tier, pool, log
        pool.on_evict = self.save_evicted

    def save_evicted(self, block: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Copy a cached device block that is about to hold other tokens to the CPU tier."""
        cpu = self.tier.save(block_hash, tokens)
        if cpu is not None:
            self.log("offload", [(block, cpu)])

    def find(self, _index: int, block_hash: int, tokens: tuple[int, ...]) -> tuple[str, int] | None:
        """("cpu", block) when the tier holds this prompt block (a ``PrefixCache`` tier)."""
        cpu = self.tier.find(block_hash, tokens)
        return None if cpu is None else ("cpu", cpu)

    def load(self, cpu: int, block_hash: int, tokens: tuple[int, ...]) -> int:
        """A fresh device block that the step's block moves fill from offloaded block ``cpu``,
        registered in the device cache at once (the copy runs before anything reads it)."""
        (block,) = self.pool.allocate(1)
        self.log("onload", [(cpu, block)])
        self.pool.register(block, block_hash, tokens)
        self.tier.num_loaded += 1
        return block
