"""vLLM's policy: blocks are allocated on demand, so waste is confined to each request's last
block. Blocks can be shared (forked sequences, prefix caching) by reference count; a shared
block that must be written is copied first (copy-on-write). Preempted requests can be swapped
to a CPU block pool, each shared block once (core/kv/swap.py). Prefix caching shares the
blocks of a cached prefix (hashing and lookup: core/kv/prefix_cache.py). With
``offload_blocks``, cached blocks evicted from the device are kept in a CPU tier and copied
back on a later hit (core/kv/offload.py). With a KV connector (kv_transfer/), prompt blocks
are saved for other engines, and blocks they saved are loaded instead of computed
(disaggregated prefill; core/kv/connector_lookup.py). With a sliding window (a model whose
every layer attends to its last W positions), blocks that fell wholly out of the window are
freed as soon as they do, their table entries becoming NULL_BLOCK (core/kv/block_table.py;
no torch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from paged_llm.core.block_pool import BlockPool
from paged_llm.core.kv.base import KVCacheManager, KVCacheStats, MemoryBreakdown
from paged_llm.core.kv.block_table import NULL_BLOCK, live_blocks
from paged_llm.core.kv.connector_lookup import ConnectorLookup
from paged_llm.core.kv.offload import OffloadedPrefixes, PrefixOffloadTier
from paged_llm.core.kv.prefix_cache import PrefixCache, TierLoad, TierLookup
from paged_llm.core.kv.swap import SwapSpace
from paged_llm.core.request import Request
from paged_llm.utils.checks import check_window

# NULL_BLOCK and live_blocks live in block_table.py; importing them from here still works
__all__ = ["NULL_BLOCK", "PagedKVCacheManager", "live_blocks"]


class PagedKVCacheManager(KVCacheManager):
    """On-demand paged allocation with sharing, optional prefix caching and a CPU swap pool."""

    name = "paged"
    supports_swap = True
    supports_sharing = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        offload_blocks: int = 0,
        kv_connector: Any = None,  # kv_transfer's scheduler side (block_keys, contains)
    ) -> None:
        super().__init__(num_blocks, block_size, max_model_len)
        check_window(sliding_window)
        if offload_blocks and not enable_prefix_caching:
            raise ValueError("KV offloading is a tier of the prefix cache; it needs "
                             "enable_prefix_caching=True")  # fmt: skip
        # Every token sees only its last sliding_window positions, so earlier blocks can go.
        self.sliding_window = sliding_window
        self._num_released: dict[str, int] = {}  # request -> leading NULL_BLOCK entries
        self.max_step_tokens: int | None = None  # see bound_step_tokens
        self.pool = BlockPool(num_blocks)
        self._swap = SwapSpace(num_cpu_blocks, self.pool, block_size, self._log)
        self.cpu_pool = self._swap.cpu_pool  # the same objects, for callers that read them
        self.cpu_block_tables = self._swap.tables
        # Keep a few blocks free at admission so running requests can grow a little
        # before anyone has to be preempted (vLLM's watermark).
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._ops: list[tuple[str, list[tuple[int, int]]]] = []  # this step's block moves
        self._sharing = False  # set once any block gets a second owner (fork or cache hit)
        # hashes and counters also serve a connector's loads when prefix caching is off
        self.prefix_cache = PrefixCache(self.pool, block_size, sliding_window)
        # lower tiers of the cache: their lookups, and their loads into fresh device blocks
        self._tier_loads: dict[str, TierLoad] = {}
        self.offload = PrefixOffloadTier(offload_blocks) if offload_blocks > 0 else None
        self._offloaded = None
        if self.offload is not None:  # also copies evicted cached blocks out
            self._offloaded = OffloadedPrefixes(self.offload, self.pool, self._log)
            self._tier_loads["cpu"] = self._offloaded.load
        self.connector = kv_connector
        self._external = None
        if kv_connector is not None:
            self._external = ConnectorLookup(
                kv_connector, self.pool, block_size, enable_prefix_caching, self._log
            )
            self._tier_loads["ext"] = self._external.load
        self._loads_external = kv_connector is not None and kv_connector.can_load
        # What a finished request leaves behind, one entry per feature that keeps per-request
        # state, chosen here: free() runs only these, so with a feature off a step does not
        # enter its module (the reading path, docs/architecture.md).
        self._forgetters: list[Callable[[str], None]] = []
        if num_cpu_blocks > 0:
            self._forgetters.append(self._swap.free)
        if enable_prefix_caching or kv_connector is not None:  # the connector's loads hash
            self._forgetters.append(self.prefix_cache.forget)
        if self._external is not None:
            self._forgetters.append(self._external.forget)

    def cache_stats(self) -> KVCacheStats:
        """Prefix-cache lookups and hits, and the CPU tier's copies (KVCacheManager's)."""
        tier = self.offload
        return KVCacheStats(
            prefix_caching=self.enable_prefix_caching,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            offload=None if tier is None else (tier.num_saved, tier.num_loaded),
            offload_blocks=0 if tier is None else tier.num_blocks,
        )

    @property
    def prefix_queries(self) -> int:
        """Blocks looked up in the prefix cache."""
        return self.prefix_cache.queries

    @property
    def prefix_hits(self) -> int:
        """Of which found (on the device, in the offload tier or in the connector's store)."""
        return self.prefix_cache.hits

    def num_free_blocks(self) -> int:
        """Free device blocks."""
        return self.pool.num_free

    def fits_ever(self, request: Request) -> bool:
        """The request at its longest must fit in the whole pool (alone, it would otherwise
        preempt itself forever)."""
        return self.blocks_at_most(request.max_total_tokens) <= self.num_blocks

    def bound_step_tokens(self, max_step_tokens: int | None) -> None:
        """Remember the most tokens a request computes in one step (None: unbounded)."""
        self.max_step_tokens = max_step_tokens

    def blocks_at_most(self, num_tokens: int) -> int:
        """All of a request's blocks, or with a sliding window and a bound C on the tokens a
        step computes: the blocks of its last W positions plus one step's C, at most
        ceil((W + C) / block_size) + 2 (one partial block at each end). So with chunked
        prefill a windowed model's requests may be longer than the whole pool."""
        full = self.blocks_for(num_tokens)
        if self.sliding_window is None or self.max_step_tokens is None:
            return full
        return min(full, self.blocks_for(self.sliding_window + self.max_step_tokens) + 2)

    def group_blocks_needed(self, requests: list[Request]) -> int:
        """The base rule plus the admission watermark, which a group re-admitted after a
        recomputation must leave free as it admits its last member."""
        return super().group_blocks_needed(requests) + self.watermark_blocks

    def _blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        table = self.block_tables.get(request.request_id, ())
        new = max(0, self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(table))
        return new + len(self._shared_blocks_to_write(request, num_new_tokens))

    def _shared_blocks_to_write(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices in the block table of shared blocks the new tokens would write into."""
        table = self.block_tables.get(request.request_id)
        if not table or num_new_tokens <= 0:
            return []
        first = request.num_computed_tokens // self.block_size
        last = min(len(table), self.blocks_for(request.num_computed_tokens + num_new_tokens))
        return [i for i in range(first, last) if self.pool.ref_counts[table[i]] > 1]

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Admit when the new tokens' blocks fit above the watermark."""
        need = self._blocks_needed(request, num_new_tokens)
        return self.pool.num_free - need >= min(self.watermark_blocks, self.num_blocks - need)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Append just enough blocks for the new tokens, copying shared blocks they write."""
        # (_blocks_needed's rule, computed once: every running request calls this every step)
        shared = self._shared_blocks_to_write(request, num_new_tokens)
        table = self.block_tables.get(request.request_id)
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(table or ())
        if max(0, need) + len(shared) > self.pool.num_free:
            return False
        if table is None:
            table = self.block_tables[request.request_id] = []
        for i in shared:
            (fresh,) = self.pool.allocate(1)
            self._log("copy", [(table[i], fresh)])
            self.pool.release([table[i]])
            table[i] = fresh
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def decode_block_steps(self, request: Request, num_steps: int) -> range | None:
        """A new block each time a decode step crosses past the table's end (KVCacheManager's);
        None where a step does more: a copy-on-write of a shared block it writes, a release
        behind a sliding window, a prefix-cache registration or a KV connector's save."""
        table = self.block_tables.get(request.request_id)
        plain = self.sliding_window is None and not self.enable_prefix_caching
        if not table or not plain or self.connector is not None:
            return None
        computed, bs = request.num_computed_tokens, self.block_size
        if any(self.pool.ref_counts[b] > 1 for b in table[computed // bs :]):
            return None  # a block it would write is shared: copied on write
        return range(len(table) * bs - computed + 1, num_steps + 1, bs)

    def _log(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        """Append block moves; consecutive moves of one kind batch while no block is reused."""
        if self._ops and self._ops[-1][0] == kind:
            batch = self._ops[-1][1]
            touched = {b for pair in batch for b in pair}
            if not any(src in touched or dst in touched for src, dst in pairs):
                batch.extend(pairs)
                return
        self._ops.append((kind, list(pairs)))

    def take_block_ops(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """This step's copy-on-write copies and swaps, in decision order."""
        ops, self._ops = self._ops, []
        return ops

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks, shared by reference (no copy until a write)."""
        table = list(self.block_tables.get(parent.request_id, []))
        self.pool.share(live_blocks(table))
        self._sharing = True
        self.block_tables[child.request_id] = table
        if parent.request_id in self._num_released:
            self._num_released[child.request_id] = self._num_released[parent.request_id]
        self.prefix_cache.fork(parent.request_id, child.request_id)
        if self._external is not None:
            self._external.fork(parent.request_id, child.request_id)

    def free(self, request: Request) -> None:
        """Release device and swapped blocks of the request."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # tail first: a prefix's later blocks are evicted before its first ones, which
            # every longer match needs (vLLM does the same)
            self.pool.release(live_blocks(table)[::-1])
        for forget in self._forgetters:
            forget(request.request_id)
        self._num_released.pop(request.request_id, None)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the blocks past ``num_tokens`` (slots of rejected draft tokens)."""
        table = self.block_tables.get(request.request_id)
        keep = self.blocks_for(num_tokens)
        if table and len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]

    # ---- prefix caching ---------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the request's first num_tokens // block_size full blocks."""
        return self.prefix_cache.block_hashes(request, num_tokens)

    def prepare_admission(self, request: Request) -> None:
        """Share cached blocks of the longest cached prefix (on the device, in the CPU tier or
        in the KV connector's store); one token at least is left to run."""
        if not (self.enable_prefix_caching or self._loads_external):
            return
        if request.request_id in self.block_tables:
            return
        if not request.may_use_cached_prefix:
            return
        # never the whole prompt: the last token must run to produce logits
        hashes = self._block_hashes(request, request.num_tokens - 1)
        tiers: list[TierLookup] = []  # where a block missing on the device is looked for next
        if self._offloaded is not None:
            tiers.append(self._offloaded.find)
        if self._loads_external:
            tiers.append(self._external.tier_for(request, len(hashes)))
        found, keys = self.prefix_cache.find(hashes, request.all_token_ids, tiers)
        num_hit, first = self.prefix_cache.longest_prefix(found)
        num_hit = self.prefix_cache.affordable(found, first, num_hit)
        self.prefix_cache.count(len(hashes), num_hit)
        # With a sliding window the first query (at the end of the prefix) reads only the last
        # W positions: blocks before them are neither needed nor taken (their entries stay NULL).
        hits = found[first:num_hit]
        # offloaded hits are pinned while fresh blocks are allocated for them: an allocation
        # evicts (and offloads) other cached blocks, never one of these
        offloaded = [b[1] for b in hits if not isinstance(b, int) and b[0] == "cpu"]
        if self.offload is not None:
            self.offload.pin(offloaded)
        table = self.prefix_cache.take(hits, first, hashes, keys, self._tier_loads)
        if self.offload is not None:
            self.offload.unpin(offloaded)
        self._sharing = self._sharing or any(isinstance(b, int) for b in hits)
        request.num_cached_tokens = num_hit * self.block_size
        if num_hit:
            self.block_tables[request.request_id] = [NULL_BLOCK] * first + table
            if first:
                self._num_released[request.request_id] = first
            request.num_computed_tokens = num_hit * self.block_size

    def plan_kv_saves(self, scheduled: list[Any]) -> None:
        """Producer: log a save of every full prompt block this step computes that the
        connector's store lacks (the runner writes them after the forward pass)."""
        if self._external is not None and self._external.can_save:
            self._external.plan_saves(scheduled, self.block_tables)

    def cancel_admission(self, request: Request) -> None:
        """Undo prepare_admission for a request that did not get in after all."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.release(live_blocks(table))
            request.num_computed_tokens = 0
        self._num_released.pop(request.request_id, None)
        request.num_cached_tokens = 0

    def on_computed(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache, then free
        the blocks that fell out of the sliding window."""
        if self.enable_prefix_caching:
            # freed blocks (out of the window) were registered before they were freed
            start = self._num_released.get(request.request_id, 0)
            table = self.block_tables.get(request.request_id, [])
            self.prefix_cache.register(request, table, start)
        if self.sliding_window is not None:
            self._release_out_of_window(request)

    def _release_out_of_window(self, request: Request) -> None:
        """Free the blocks no later token can see: the next query sits at position
        num_computed_tokens or later and sees back to num_computed_tokens - W + 1. One more
        position is kept, so a sequence forked to recompute the last token (a parallel
        sample) still finds its whole window."""
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        first_seen = max(0, request.num_computed_tokens - self.sliding_window)
        dead = min(len(table), first_seen // self.block_size)
        start = self._num_released.get(request.request_id, 0)
        if dead <= start:
            return
        self.pool.release(table[start:dead][::-1])  # later blocks first, as in free()
        table[start:dead] = [NULL_BLOCK] * (dead - start)
        self._num_released[request.request_id] = dead

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block, offloaded ones too; False while requests hold
        blocks."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.reset()
        return True

    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt blocks found in the cache."""
        return self.cache_stats().prefix_hit_rate

    # ---- swapping (core/kv/swap.py) -----------------------------------------------------------
    def swap_out(self, requests: list[Request]) -> list[tuple[int, int]] | None:
        """All-or-nothing: move the requests' blocks to CPU, each shared block once."""
        mapping = self._swap.swap_out(requests, self.block_tables)
        if mapping is not None:  # their device blocks are free now: cached ones may go
            for r in requests:
                self.prefix_cache.forget_offers(r.request_id)
        return mapping

    def can_swap_in(self, requests: list[Request], num_new_tokens: int) -> bool:
        """True when the swapped blocks and the next tokens' blocks fit on the device."""
        return self._swap.can_swap_in(requests, num_new_tokens)

    def swap_in(self, requests: list[Request]) -> list[tuple[int, int]]:
        """Move the requests' swapped blocks back to the device, each shared block once."""
        return self._swap.swap_in(requests, self.block_tables)

    def memory_breakdown(self, requests: Iterable[Request]) -> MemoryBreakdown:
        """Token states vs. unfilled slots in allocated blocks vs. free blocks.

        A block shared by several requests counts once, with the most tokens any owner keeps
        in it, so sharing shows up as saved memory rather than as double counting.
        """
        bs = self.block_size
        if not self._sharing:  # every block has one owner: no need to deduplicate
            allocated = token_states = 0
            for req in requests:
                released = self._num_released.get(req.request_id, 0)  # out of the window
                slots = (len(self.block_tables.get(req.request_id, ())) - released) * bs
                allocated += slots
                token_states += min(req.num_tokens - released * bs, slots)
            return MemoryBreakdown(
                token_states, 0, allocated - token_states, self.num_slots - allocated
            )
        filled: dict[int, int] = {}
        for req in requests:
            table = self.block_tables.get(req.request_id, ())
            for i, b in enumerate(table):
                if b == NULL_BLOCK:
                    continue
                used = min(bs, max(0, req.num_tokens - i * bs))
                filled[b] = max(filled.get(b, 0), used)
        allocated = len(filled) * bs
        token_states = sum(filled.values())
        return MemoryBreakdown(
            token_states=token_states,
            reservation=0,
            internal_fragmentation=allocated - token_states,
            external_fragmentation=self.num_slots - allocated,
        )
