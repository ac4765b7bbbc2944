"""vLLM's policy: blocks are allocated on demand, one at a time, so waste is confined to each
request's last block; preempted requests can be swapped to a CPU block pool (no torch)."""

from __future__ import annotations

from collections.abc import Iterable

from paged_llm.core.block_pool import BlockPool
from paged_llm.core.kv.base import KVCacheManager, MemoryBreakdown
from paged_llm.core.request import Request


class PagedKVCacheManager(KVCacheManager):
    """On-demand paged allocation with an optional CPU swap pool."""

    name = "paged"
    supports_swap = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
    ) -> None:
        super().__init__(num_blocks, block_size, max_model_len)
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.cpu_block_tables: dict[str, list[int]] = {}
        # Keep a few blocks free at admission so running requests can grow a little
        # before anyone has to be preempted (vLLM's watermark).
        self.watermark_blocks = int(watermark * num_blocks)

    def num_free_blocks(self) -> int:
        """Free device blocks."""
        return self.pool.num_free

    def fits_ever(self, request: Request) -> bool:
        """The prompt plus one generated token must fit in the whole pool."""
        return self.blocks_for(request.num_prompt_tokens + 1) <= self.num_blocks

    def _blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        held = len(self.block_tables.get(request.request_id, ()))
        return max(0, self.blocks_for(request.num_computed_tokens + num_new_tokens) - held)

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Admit when the new tokens' blocks fit above the watermark."""
        need = self._blocks_needed(request, num_new_tokens)
        return self.pool.num_free - need >= min(self.watermark_blocks, self.num_blocks - need)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Append just enough blocks for the new tokens."""
        need = self._blocks_needed(request, num_new_tokens)
        if need > self.pool.num_free:
            return False
        table = self.block_tables.setdefault(request.request_id, [])
        table.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Release device and swapped blocks of the request."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.release(table)
        cpu_table = self.cpu_block_tables.pop(request.request_id, None)
        if cpu_table and self.cpu_pool is not None:
            self.cpu_pool.release(cpu_table)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """All-or-nothing: move every block of the request to the CPU pool."""
        table = self.block_tables.get(request.request_id, [])
        if self.cpu_pool is None or len(table) > self.cpu_pool.num_free:
            return None
        cpu_table = self.cpu_pool.allocate(len(table))
        self.cpu_block_tables[request.request_id] = cpu_table
        self.pool.release(self.block_tables.pop(request.request_id))
        return list(zip(table, cpu_table))

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """True when the swapped blocks and the next tokens' blocks fit on the device."""
        held = len(self.cpu_block_tables.get(request.request_id, ()))
        need = max(held, self.blocks_for(request.num_computed_tokens + num_new_tokens))
        return need <= self.pool.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move every swapped block of the request back to the device."""
        cpu_table = self.cpu_block_tables.pop(request.request_id)
        table = self.pool.allocate(len(cpu_table))
        self.block_tables[request.request_id] = table
        assert self.cpu_pool is not None
        self.cpu_pool.release(cpu_table)
        return list(zip(cpu_table, table))

    def memory_breakdown(self, requests: Iterable[Request]) -> MemoryBreakdown:
        """Token states vs. unfilled slots in allocated blocks vs. free blocks."""
        token_states = allocated = 0
        for req in requests:
            table = self.block_tables.get(req.request_id)
            if not table:
                continue
            slots = len(table) * self.block_size
            allocated += slots
            token_states += min(req.num_tokens, slots)
        return MemoryBreakdown(
            token_states=token_states,
            reservation=0,
            internal_fragmentation=allocated - token_states,
            external_fragmentation=self.num_slots - allocated,
        )
