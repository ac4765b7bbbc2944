"""vLLM's policy: blocks are allocated on demand, so waste is confined to each request's last
block. Blocks can be shared (forked sequences, prefix caching) by reference count; a shared
block that must be written is copied first (copy-on-write). Preempted requests can be swapped
to a CPU block pool, each shared block once (core/kv/swap.py). Prefix caching shares the
blocks of a cached prefix (hashing and lookup: core/kv/prefix_cache.py). With
``offload_blocks``, cached blocks evicted from the device are kept in a CPU tier and copied
back on a later hit (core/kv/offload.py). With a KV connector (kv_transfer/), prompt blocks
are saved for other engines, and blocks they saved are loaded instead of computed
(disaggregated prefill; core/kv/connector_lookup.py); core/kv/cached_prefixes.py admits
requests from these cached prefixes. With a sliding window (a model whose every layer attends
to its last W positions), blocks that fell wholly out of the window are freed as soon as they
do, their table entries becoming NULL_BLOCK (core/kv/sliding_window.py). No torch.

Each feature is attached when the manager is built, as hooks that run at admission, after a
step and when a request ends; with a feature off, a step never enters its module."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from paged_llm.core.kv.base import NULL_BLOCK, BlockAllocator, KVCacheManager, live_blocks
from paged_llm.core.kv.block_pool import BlockPool
from paged_llm.core.kv.cached_prefixes import CachedPrefixes
from paged_llm.core.kv.paged_memory import paged_memory_breakdown
from paged_llm.core.kv.sliding_window import WindowRelease
from paged_llm.core.kv.stats import KVCacheStats, MemoryBreakdown
from paged_llm.core.kv.swap import SwapSpace
from paged_llm.core.request import Request
from paged_llm.utils.checks import check_window

# NULL_BLOCK and live_blocks live in kv/base.py; importing them from here still works
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
        # the prefix cache's index of what freed blocks hold, only where something reads it
        cached = enable_prefix_caching or kv_connector is not None
        self.pool = (BlockPool if cached else BlockAllocator)(num_blocks)
        self._swap = SwapSpace(num_cpu_blocks, self.pool, block_size, self._log)
        self.cpu_pool = self._swap.cpu_pool  # the same objects, for callers that read them
        self.cpu_block_tables = self._swap.tables
        # Keep a few blocks free at admission so running requests can grow a little
        # before anyone has to be preempted (vLLM's watermark).
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._ops: list[tuple[str, list[tuple[int, int]]]] = []  # this step's block moves
        self._sharing = False  # set once any block gets a second owner (fork or cache hit)
        # prefix caching, its CPU tier and a KV connector's loads and saves
        self.prefixes = CachedPrefixes(self, offload_blocks, kv_connector)
        self.prefix_cache = self.prefixes.cache  # the same objects, for callers that read them
        self.offload = self.prefixes.offload
        self.connector = kv_connector
        self._external = self.prefixes.external
        # The hooks of the features this manager has, chosen here: admission, the end of a
        # step and the end of a request run only these, so with a feature off a step does not
        # enter its module (the reading path, docs/architecture.md).
        self._admitters: list[Callable[[Request], None]] = []
        if enable_prefix_caching or self.prefixes.loads_external:
            self._admitters.append(self.prefixes.admit)
        self._computed: list[Callable[[Request], None]] = []  # after num_computed_tokens grew
        if enable_prefix_caching:
            self._computed.append(self.prefixes.register)
        if sliding_window is not None:  # after the registration: freed blocks stay registered
            self._computed.append(WindowRelease(self).release)
        self._forgetters: list[Callable[[str], None]] = []  # what a finished request leaves
        if num_cpu_blocks > 0:
            self._forgetters.append(self._swap.free)
        if enable_prefix_caching or kv_connector is not None:  # the connector's loads hash
            self._forgetters.append(self.prefix_cache.forget)
        if self._external is not None:
            self._forgetters.append(self._external.forget)
        self._saves = None  # a KV connector's producer saves the prompt blocks a step computes
        if self._external is not None and self._external.can_save:
            self._saves = self._external.plan_saves

    def cache_stats(self) -> KVCacheStats:
        """Prefix-cache lookups and hits, and the CPU tier's copies (KVCacheManager's)."""
        return self.prefixes.stats()

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

    # ---- hooks of the features chosen in __init__ -------------------------------------------
    def prepare_admission(self, request: Request) -> None:
        """Share cached blocks of the longest cached prefix (core/kv/cached_prefixes.py)."""
        for admit in self._admitters:
            admit(request)

    def plan_kv_saves(self, scheduled: list[Any]) -> None:
        """Producer: log a save of every full prompt block this step computes that the
        connector's store lacks (the runner writes them after the forward pass)."""
        if self._saves is not None:
            self._saves(scheduled, self.block_tables)

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
        the blocks that fell out of the sliding window (each where the feature is on)."""
        for hook in self._computed:
            hook(request)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block, offloaded ones too; False while requests hold
        blocks."""
        return self.prefixes.reset()

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
        """Token states vs. unfilled slots in allocated blocks vs. free blocks, a shared block
        counted once (core/kv/paged_memory.py)."""
        return paged_memory_breakdown(self, requests)
