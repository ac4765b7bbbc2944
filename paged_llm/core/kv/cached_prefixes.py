"""Admission from cached prefixes, for the paged policy (no torch): a waiting request takes the
blocks of its longest cached prefix (on the device, in the CPU offload tier or in a KV
connector's store) instead of computing them, and the full blocks a step completes are
registered for later requests. Hashing and lookup: core/kv/prefix_cache.py; the CPU tier:
core/kv/offload.py; the connector: core/kv/connector_lookup.py.

``PagedKVCacheManager`` builds one always (its counters and hashes are cheap) but calls it at
admission and after a step only with prefix caching or a KV connector, a choice made when the
manager is built: a step without them never enters this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paged_llm.core.kv.base import NULL_BLOCK, KVCacheStats
from paged_llm.core.kv.connector_lookup import ConnectorLookup
from paged_llm.core.kv.offload import OffloadedPrefixes, PrefixOffloadTier
from paged_llm.core.kv.prefix_cache import PrefixCache, TierLoad, TierLookup
from paged_llm.core.request import Request

if TYPE_CHECKING:
    from paged_llm.core.kv.paged import PagedKVCacheManager


class CachedPrefixes:
    """The paged manager's prefix cache with its lower tiers: lookups at admission,
    registration after a step, and their counters."""

    def __init__(self, kv: PagedKVCacheManager, offload_blocks: int, kv_connector: Any) -> None:
        self.kv = kv
        # hashes and counters also serve a connector's loads when prefix caching is off
        self.cache = PrefixCache(kv.pool, kv.block_size, kv.sliding_window)
        # lower tiers of the cache: their lookups, and their loads into fresh device blocks
        self._tier_loads: dict[str, TierLoad] = {}
        self.offload = PrefixOffloadTier(offload_blocks) if offload_blocks > 0 else None
        self._offloaded = None
        if self.offload is not None:  # also copies evicted cached blocks out
            self._offloaded = OffloadedPrefixes(self.offload, kv.pool, kv._log)
            self._tier_loads["cpu"] = self._offloaded.load
        self.external = None
        if kv_connector is not None:
            self.external = ConnectorLookup(
                kv_connector, kv.pool, kv.block_size, kv.enable_prefix_caching, kv._log
            )
            self._tier_loads["ext"] = self.external.load
        self.loads_external = kv_connector is not None and kv_connector.can_load

    def stats(self) -> KVCacheStats:
        """Prefix-cache lookups and hits, and the CPU tier's copies."""
        tier = self.offload
        return KVCacheStats(
            prefix_caching=self.kv.enable_prefix_caching,
            prefix_queries=self.cache.queries,
            prefix_hits=self.cache.hits,
            offload=None if tier is None else (tier.num_saved, tier.num_loaded),
            offload_blocks=0 if tier is None else tier.num_blocks,
        )

    def admit(self, request: Request) -> None:
        """Share cached blocks of the longest cached prefix (on the device, in the CPU tier or
        in the KV connector's store); one token at least is left to run."""
        kv = self.kv
        if request.request_id in kv.block_tables:
            return
        if not request.may_use_cached_prefix:
            return
        # never the whole prompt: the last token must run to produce logits
        hashes = self.cache.block_hashes(request, request.num_tokens - 1)
        tiers: list[TierLookup] = []  # where a block missing on the device is looked for next
        if self._offloaded is not None:
            tiers.append(self._offloaded.find)
        if self.loads_external:
            tiers.append(self.external.tier_for(request, len(hashes)))
        found, keys = self.cache.find(hashes, request.all_token_ids, tiers)
        num_hit, first = self.cache.longest_prefix(found)
        num_hit = self.cache.affordable(found, first, num_hit)
        self.cache.count(len(hashes), num_hit)
        # With a sliding window the first query (at the end of the prefix) reads only the last
        # W positions: blocks before them are neither needed nor taken (their entries stay NULL).
        hits = found[first:num_hit]
        # offloaded hits are pinned while fresh blocks are allocated for them: an allocation
        # evicts (and offloads) other cached blocks, never one of these
        offloaded = [b[1] for b in hits if not isinstance(b, int) and b[0] == "cpu"]
        if self.offload is not None:
            self.offload.pin(offloaded)
        table = self.cache.take(hits, first, hashes, keys, self._tier_loads)
        if self.offload is not None:
            self.offload.unpin(offloaded)
        kv._sharing = kv._sharing or any(isinstance(b, int) for b in hits)
        request.num_cached_tokens = num_hit * kv.block_size
        if num_hit:
            kv.block_tables[request.request_id] = [NULL_BLOCK] * first + table
            if first:
                kv._num_released[request.request_id] = first
            request.num_computed_tokens = num_hit * kv.block_size

    def register(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        kv = self.kv
        # freed blocks (out of the window) were registered before they were freed
        start = kv._num_released.get(request.request_id, 0)
        table = kv.block_tables.get(request.request_id, [])
        self.cache.register(request, table, start)

    def reset(self) -> bool:
        """Drop every cached prefix block, offloaded ones too; False while requests hold
        blocks."""
        if not self.kv.pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.reset()
        return True
