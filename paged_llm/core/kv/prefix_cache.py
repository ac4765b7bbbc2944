"""The prefix cache's bookkeeping for the paged policy: chained hashes of each request's full
blocks, the walk that finds a prompt's cached blocks (on the device first, then in the lower
tiers the manager passes: the CPU offload tier, a KV connector's store), how long a prefix an
admission may take, and the hit counters (no torch).

A block's hash chains the hash of the block before it (vLLM's scheme), so equal hashes mean
equal prefixes up to collisions, which ``BlockPool.lookup`` rules out by comparing token ids.
The cached blocks themselves live in the device ``BlockPool``; this class only reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from paged_llm.core.kv.block_pool import BlockPool
from paged_llm.core.request import Request

# What the walk found for one prompt block: a cached device block, (tier, id) in a lower tier
# (("cpu", block) in the offload tier, ("ext", key) in a connector's store), or None (a miss).
Hit = int | tuple[str, int] | None
# A lower tier's lookup of prompt block i: (i, chained hash, token ids) -> (tier, id) or None.
TierLookup = Callable[[int, int, tuple[int, ...]], tuple[str, int] | None]
# A lower tier's load: (id, chained hash, token ids) -> the fresh device block it fills.
TierLoad = Callable[[int, int, tuple[int, ...]], int]


class PrefixCache:
    """Hashes and finds a request's cached prefix blocks; counts queries and hits."""

    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.hashes: dict[str, list[int]] = {}  # request -> chained hashes of its full blocks
        # request -> (its table object, full blocks offered, indices whose offer the pool
        # declined) at the last offer; valid while the request holds its blocks
        self.offered: dict[str, tuple[list[int], int, list[int]]] = {}
        self.queries = 0  # blocks looked up
        self.hits = 0  # of which found (on the device or in a lower tier)

    def block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the request's first num_tokens // block_size full blocks."""
        hashes = self.hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = None
        while len(hashes) < num_tokens // bs:
            tokens = tokens or request.all_token_ids
            i = len(hashes)
            # a LoRA adapter changes every layer's K/V, so its blocks form their own chains
            seed = ("lora", request.lora_int_id) if request.lora_int_id else None
            prev = hashes[-1] if hashes else seed
            hashes.append(hash((prev, tuple(tokens[i * bs : (i + 1) * bs]))))
        # the list may run further (admission hashes the whole prompt): only the asked-for blocks,
        # or a block half-computed by a chunk would be registered as full
        return hashes[: num_tokens // bs]

    def find(
        self, hashes: list[int], tokens: Sequence[int], tiers: Sequence[TierLookup] = ()
    ) -> tuple[list[Hit], list[tuple[int, ...]]]:
        """(per prompt block: its hit, the blocks' token ids), looked up on the device, then in
        each of ``tiers`` in order. Without a sliding window the walk stops at the first miss
        (a full-attention prefix needs every block from the start)."""
        bs = self.block_size
        found: list[Hit] = []
        keys: list[tuple[int, ...]] = []  # the looked-up blocks' token ids (up to a miss)
        for i, h in enumerate(hashes):
            key = tuple(tokens[i * bs : (i + 1) * bs])
            keys.append(key)
            hit: Hit = self.pool.lookup(h, key)
            for tier in tiers:
                if hit is not None:
                    break
                hit = tier(i, h, key)
            found.append(hit)
            if hit is None and self.sliding_window is None:
                break
        return found, keys

    def longest_prefix(self, found: list[Hit]) -> tuple[int, int]:
        """(blocks of the longest prefix that need not be computed, the first of them the next
        query reads). Full attention: the leading run of cached blocks. A sliding window: the
        longest prefix whose blocks inside the window are cached, whatever came before (vLLM's
        sliding-window rule; earlier blocks may have been evicted)."""
        if self.sliding_window is None:
            num = next((i for i, b in enumerate(found) if b is None), len(found))
            return num, 0
        for num in range(len(found), 0, -1):
            first = max(0, num * self.block_size - self.sliding_window) // self.block_size
            if all(b is not None for b in found[first:num]):
                return num, first
        return 0, 0

    def affordable(self, found: list[Hit], first: int, num_hit: int) -> int:
        """``num_hit`` cut where the hits would need more free device blocks than there are:
        a lower tier's block needs a fresh one, a cached block nobody holds leaves the free
        list."""
        free = self.pool.num_free
        for i in range(first, num_hit):
            b = found[i]
            free -= 1 if not isinstance(b, int) or self.pool.ref_counts[b] == 0 else 0
            if free < 0:  # (a windowed prefix cut short would need other blocks: none)
                return i if self.sliding_window is None else 0
        return num_hit

    def take(
        self,
        hits: list[Hit],
        first: int,
        hashes: list[int],
        keys: list[tuple[int, ...]],
        loads: dict[str, TierLoad],
    ) -> list[int]:
        """The device blocks of prompt blocks first, first + 1, ... (``hits``, no misses): a
        cached block gets one more reference, a lower tier's is loaded into a fresh one by
        ``loads[tier]``. Cached blocks are taken first, so allocating the fresh blocks evicts
        (and offloads) other cached blocks, never one of these."""
        for b in hits:
            if isinstance(b, int):
                self.pool.take_cached(b)
        return [
            b if isinstance(b, int) else loads[b[0]](b[1], hashes[i], keys[i])
            for i, b in enumerate(hits, start=first)
        ]

    def count(self, queried: int, hit: int) -> None:
        """Add one admission's looked-up and found blocks to the counters."""
        self.queries += queried
        self.hits += hit

    def hit_rate(self) -> float:
        """Fraction of looked-up prompt blocks found in the cache."""
        return self.hits / self.queries if self.queries else 0.0

    def register(self, request: Request, table: list[int], start: int) -> None:
        """Offer every full, computed block of the request from table index ``start`` on (the
        ones before were freed by a sliding window, registered already) to the cache.

        Runs for every request every step, so it offers only what is new: the blocks filled
        since the last offer, and those the pool declined then (an identical block was
        cached; it may be gone now). A block the pool took stays cached while the request
        holds it (eviction takes free blocks only), and while the table object is the same
        its full blocks stay put (a copy-on-write replaces only blocks being written, a
        window frees them below ``start``, a truncation cuts past them); a swap-out, which
        gives the blocks up, drops the record (``forget_offers``)."""
        full = request.num_computed_tokens // self.block_size
        kept = self.offered.get(request.request_id)
        first, declined = (kept[1], kept[2]) if kept is not None and kept[0] is table else (0, [])
        if first == full and not declined:
            return  # most steps: a block fills every block_size tokens
        hashes = self.block_hashes(request, request.num_computed_tokens)
        end = min(len(hashes), len(table))
        tokens = None  # joined only when a block is offered
        bs = self.block_size
        still_declined = []
        for i in [*declined, *range(first, end)]:
            if i < start or i >= end or self.pool.is_cached(table[i]):
                continue
            tokens = tokens if tokens is not None else request.all_token_ids
            self.pool.register(table[i], hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
            if not self.pool.is_cached(table[i]):
                still_declined.append(i)
        self.offered[request.request_id] = (table, end, still_declined)

    def forget_offers(self, request_id: str) -> None:
        """The request gave its blocks up (swapped out): offer every block again once back."""
        self.offered.pop(request_id, None)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares the parent's tokens so far, hence its hashes."""
        if parent_id in self.hashes:
            self.hashes[child_id] = list(self.hashes[parent_id])

    def forget(self, request_id: str) -> None:
        """Drop a finished request's hashes."""
        self.hashes.pop(request_id, None)
        self.offered.pop(request_id, None)
