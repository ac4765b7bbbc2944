"""The KV cache manager interface shared by the paged policy and the reservation baselines,
and the physical blocks a paged manager hands out: an O(1) free list in LRU order with
reference counts, so blocks can be shared (forked sequences, cached prefixes). No torch.

A block table lists a request's block ids in logical order; a sliding window leaves NULL_BLOCK
where a freed block was. The prefix cache's index of which block holds which tokens is
``BlockPool``'s (core/kv/block_pool.py), which extends ``BlockAllocator``. What a manager
reports (its memory split, its cache counters) is in core/kv/stats.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from paged_llm.core.kv.stats import KVCacheStats, MemoryBreakdown
from paged_llm.core.request import Request

# (KVCacheStats and MemoryBreakdown, the reports, are re-exported)
__all__ = ["NULL_BLOCK", "BlockAllocator", "KVCacheManager", "KVCacheStats", "MemoryBreakdown",
           "live_blocks"]  # fmt: skip

# A block-table entry whose block fell out of the sliding window and went back to the pool.
# Such entries are a prefix of the table; kernels never read them (the runner writes block 0
# in their place). Keeping the entry keeps logical block i at table index i.
NULL_BLOCK = -1


def live_blocks(table: list[int]) -> list[int]:
    """The real block ids of a table (without the NULL_BLOCK entries of a sliding window)."""
    return [b for b in table if b != NULL_BLOCK]


class BlockAllocator:
    """Hands out block ids; a block returns to the free list when its last reference drops."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order = LRU
        self.ref_counts = [0] * num_blocks

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

    def reset_prefix_cache(self) -> bool:
        """Nothing is cached here: refused (False) only while a block is referenced, as
        ``BlockPool``'s is."""
        return not any(self.ref_counts)

    def _evict(self, block: int) -> None:
        """Forget what a block taken from the free list held (nothing, without a cache)."""


class KVCacheManager(ABC):
    """Answers 'can this request get slots for N more tokens?' and owns the block tables."""

    name = "base"
    supports_swap = False
    # True when each request's blocks form one contiguous run (what the contiguous backend reads)
    contiguous_blocks = False
    # FasterTransformer-style static batching: admit a new batch only after the last one ends.
    static_batching = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_tables: dict[str, list[int]] = {}

    def cache_stats(self) -> KVCacheStats | None:
        """This manager's prefix-cache and offload counters; None where it caches nothing."""
        return None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` slots."""
        return -(-num_tokens // self.block_size)

    @property
    def num_slots(self) -> int:
        """Pool size in token slots."""
        return self.num_blocks * self.block_size

    @property
    def max_request_slots(self) -> int:
        """The most token slots one request can ever hold (all of the pool, unless the policy
        needs contiguous runs)."""
        return self.num_slots

    def get_block_table(self, request: Request) -> list[int]:
        """Physical block ids of the request, in logical order."""
        return self.block_tables.get(request.request_id, [])

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks not owned by any request."""

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks() / self.num_blocks

    @abstractmethod
    def fits_ever(self, request: Request) -> bool:
        """False when the request could not run even in an empty pool."""

    def bound_step_tokens(self, max_step_tokens: int | None) -> None:
        """The scheduler's promise: no request computes more than ``max_step_tokens`` tokens in
        one step (chunked prefill), or None (a prefill computes its whole prompt). Only a
        policy that frees blocks while a request runs (a sliding window) can use it."""

    def blocks_at_most(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once: all of them,
        unless the policy frees some while it runs."""
        return self.blocks_for(num_tokens)

    def group_blocks_needed(self, requests: list[Request]) -> int:
        """Blocks that sequences preempted together (a request's samples or beams) may need at
        once: each at its longest length, with no credit for sharing, because after a
        preemption by recomputation each recomputes its own blocks. A group needing more than
        the pool would be preempted and resumed (or left waiting) forever."""
        return sum(self.blocks_at_most(r.max_total_tokens) for r in requests)

    def group_fits_ever(self, requests: list[Request]) -> bool:
        """The group could run together in the empty pool."""
        return self.group_blocks_needed(requests) <= self.num_blocks

    @abstractmethod
    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Admission rule for a waiting request about to compute ``num_new_tokens``."""

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Ensure slots for num_computed + num_new tokens; False (and no change) if impossible."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release everything the request holds on the device."""

    @abstractmethod
    def memory_breakdown(self, requests: Iterable[Request]) -> MemoryBreakdown:
        """Split the pool into the paper's four parts for the given live requests."""

    # ---- optional capabilities; the defaults suit policies without them -------------------
    supports_sharing = False

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share the parent's blocks (sharing policies only)."""
        raise NotImplementedError(f"policy '{self.name}' cannot share blocks")

    def decode_block_steps(self, request: Request, num_steps: int) -> range | None:
        """The steps (1-based) among the request's next ``num_steps`` one-token decode steps at
        which it takes one new block from the pool, or None when the policy cannot promise
        that plain growth (the default): the simulator's exact fast-forward (sim/fast_forward.py)
        then runs those steps through the scheduler one by one."""
        return None

    def take_block_ops(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """Block moves of this step, in the order they were decided: ("copy" | "swap_out" |
        "swap_in" | "offload" | "onload", [(src, dst), ...]), and a KV connector's ("kv_load",
        [(key, block), ...]) and ("kv_save", [(block, key), ...]), the saves last (they run after
        the forward pass). Order matters: a block freed by a swap-out can be the destination of
        a copy-on-write later in the same step, and vice versa."""
        return []

    def prepare_admission(self, request: Request) -> None:
        """Hook before admission (prefix caching sets num_computed_tokens from cache hits)."""

    def cancel_admission(self, request: Request) -> None:
        """Undo ``prepare_admission`` for a request that was not admitted."""

    def plan_kv_saves(self, scheduled: list[Any]) -> None:
        """Hook once a step is chosen: log the KV connector's saves (paged policy only)."""

    def on_computed(self, request: Request) -> None:
        """Hook after the request's num_computed_tokens advanced (prefix cache registration)."""

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; False while requests hold blocks (nothing cached
        here)."""
        return True

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back blocks beyond what ``num_tokens`` tokens need (speculative rollback)."""

    def swap_out(self, requests: list[Request]) -> list[tuple[int, int]] | None:
        """Move the requests' blocks to CPU; return (device, cpu) pairs or None if no room."""
        return None

    def can_swap_in(self, requests: list[Request], num_new_tokens: int) -> bool:
        """True when the swapped blocks and the next tokens' blocks fit on the device."""
        return False

    def swap_in(self, requests: list[Request]) -> list[tuple[int, int]]:
        """Bring swapped requests back; return (cpu, device) pairs."""
        raise NotImplementedError(f"{self.name} does not swap")
