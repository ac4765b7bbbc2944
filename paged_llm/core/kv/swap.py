"""Swap space for the paged policy (vLLM's ``swap_space``): preempted requests' blocks move to
a CPU block pool and back, all or nothing, each shared block once and shared again on the
other side, so a group of forked sequences costs its distinct blocks only (no torch).

The copies are logged as the step's ("swap_out" | "swap_in", [(src, dst)]) block moves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from paged_llm.core.kv.base import NULL_BLOCK, BlockAllocator, live_blocks
from paged_llm.core.request import Request


class SwapSpace:
    """The CPU pool and the swapped requests' CPU block tables."""

    def __init__(
        self,
        num_cpu_blocks: int,
        pool: BlockAllocator,
        block_size: int,
        log: Callable[[str, list[tuple[int, int]]], None],
    ) -> None:
        self.cpu_pool = BlockAllocator(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.tables: dict[str, list[int]] = {}  # request -> CPU block table
        self.pool, self.block_size, self.log = pool, block_size, log

    def swap_out(
        self, requests: list[Request], block_tables: dict[str, list[int]]
    ) -> list[tuple[int, int]] | None:
        """All-or-nothing: move the requests' blocks to CPU, each shared block once."""
        tables = [block_tables.get(r.request_id, []) for r in requests]
        unique = list(dict.fromkeys(b for t in tables for b in live_blocks(t)))
        if self.cpu_pool is None or len(unique) > self.cpu_pool.num_free:
            return None
        cpu_of = dict(zip(unique, self.cpu_pool.allocate(len(unique))))
        for r, table in zip(requests, tables):
            cpu_table = [cpu_of.get(b, NULL_BLOCK) for b in table]  # a freed block stays freed
            self.tables[r.request_id] = cpu_table
            block_tables.pop(r.request_id, None)
            self.pool.release(live_blocks(table)[::-1])
        # the CPU copy is owned by as many requests as owned the device block
        for table in tables:
            self.cpu_pool.share([cpu_of[b] for b in live_blocks(table)])
        self.cpu_pool.release(list(cpu_of.values()))
        self.log("swap_out", list(cpu_of.items()))
        return list(cpu_of.items())

    def can_swap_in(self, requests: list[Request], num_new_tokens: int) -> bool:
        """True when the swapped blocks and the next tokens' blocks fit on the device."""
        tables = [self.tables.get(r.request_id, []) for r in requests]
        holders = Counter(b for table in tables for b in live_blocks(table))
        need = len(holders)  # each shared block comes back once
        writers: Counter[int] = Counter()
        for r, table in zip(requests, tables):
            end = -(-(r.num_computed_tokens + num_new_tokens) // self.block_size)
            need += max(0, end - len(table))
            writers.update(table[r.num_computed_tokens // self.block_size : end])
        # k writers of a block that h sequences share copy it min(k, h - 1) times (the last
        # holder writes in place); counting exactly matters, because a group that fills the
        # whole pool must still come back when it is alone
        need += sum(min(k, holders[b] - 1) for b, k in writers.items())
        return need <= self.pool.num_free

    def swap_in(
        self, requests: list[Request], block_tables: dict[str, list[int]]
    ) -> list[tuple[int, int]]:
        """Move the requests' swapped blocks back to the device, each shared block once."""
        assert self.cpu_pool is not None
        tables = [self.tables.pop(r.request_id) for r in requests]
        unique = list(dict.fromkeys(b for t in tables for b in live_blocks(t)))
        dev_of = dict(zip(unique, self.pool.allocate(len(unique))))
        for r, cpu_table in zip(requests, tables):
            table = [dev_of.get(b, NULL_BLOCK) for b in cpu_table]
            block_tables[r.request_id] = table
            self.pool.share(live_blocks(table))
            self.cpu_pool.release(live_blocks(cpu_table))
        self.pool.release(list(dev_of.values()))
        self.log("swap_in", list(dev_of.items()))
        return list(dev_of.items())

    def free(self, request_id: str) -> None:
        """Release the request's CPU blocks, if it was swapped out."""
        cpu_table = self.tables.pop(request_id, None)
        if cpu_table and self.cpu_pool is not None:
            self.cpu_pool.release(live_blocks(cpu_table))
