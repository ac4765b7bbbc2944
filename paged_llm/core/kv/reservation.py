"""The pre-vLLM baselines: each request reserves one contiguous run of slots up front, sized by
a policy (Orca Max / Pow2 / Oracle), from a buddy allocator over the same pool (no torch)."""

from __future__ import annotations

from collections.abc import Iterable

from paged_llm.core.buddy import BuddyAllocator, ceil_log2
from paged_llm.core.kv.base import KVCacheManager, MemoryBreakdown
from paged_llm.core.request import Request


class ReservationKVCacheManager(KVCacheManager):
    """Contiguous reservation; subclasses say how many slots a request reserves."""

    name = "reservation"
    contiguous_blocks = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        # num_cpu_blocks and sliding_window are accepted for a uniform constructor:
        # reservations never swap, and a reserved run is held whole until the request ends
        # (the baselines' behaviour), whatever the model's window.
        super().__init__(num_blocks, block_size, max_model_len)
        # The largest run is one max_model_len request (the paper's buddy allocator: 2048 tokens).
        self.buddy = BuddyAllocator(num_blocks, ceil_log2(self.blocks_for(max_model_len)))
        self._run_start: dict[str, int] = {}
        self._run_len: dict[str, int] = {}

    def reserved_tokens(self, request: Request) -> int:
        """Slots this policy reserves for the request (capped at max_model_len)."""
        raise NotImplementedError

    def num_free_blocks(self) -> int:
        """Blocks in free buddy runs."""
        return self.buddy.num_free_blocks

    @property
    def max_request_slots(self) -> int:
        """One request's reservation is one buddy run: at most the largest the empty pool has."""
        return self.buddy.max_run * self.block_size

    def fits_ever(self, request: Request) -> bool:
        """The reservation, rounded up to a power-of-two run, must fit in the largest run the
        empty pool offers (a 48-block pool offers 32, not 64)."""
        return self._run_sizes([request])[0] <= self.buddy.max_run

    def _run_sizes(self, requests: list[Request]) -> list[int]:
        """The power-of-two buddy run each request's reservation takes, in blocks."""
        return [1 << ceil_log2(self.blocks_for(self.reserved_tokens(r))) for r in requests]

    def group_blocks_needed(self, requests: list[Request]) -> int:
        """Every member's whole reservation, as the power-of-two run it takes (a group is
        admitted whole)."""
        return sum(self._run_sizes(requests))

    def group_fits_ever(self, requests: list[Request]) -> bool:
        """The members' runs can all be carved out of the empty pool at once (an 11-block pool
        holds two 4-block runs, not three). Largest first, as power-of-two runs pack best."""
        empty = BuddyAllocator(self.num_blocks, self.buddy.max_order)
        return all(empty.allocate(n) for n in sorted(self._run_sizes(requests), reverse=True))

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Admit only when the whole reservation fits in one free run."""
        if request.request_id in self.block_tables:
            return True
        return self.buddy.can_allocate(self.blocks_for(self.reserved_tokens(request)))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Reserve the whole run on first call; later calls must stay inside it."""
        rid = request.request_id
        if rid not in self.block_tables:
            need = self.blocks_for(self.reserved_tokens(request))
            run = self.buddy.allocate(need)
            if run is None:
                return False
            start, length = run
            self._run_start[rid], self._run_len[rid] = start, length
            self.block_tables[rid] = list(range(start, start + need))
        capacity = len(self.block_tables[rid]) * self.block_size
        return request.num_computed_tokens + num_new_tokens <= capacity

    def decode_block_steps(self, request: Request, num_steps: int) -> range | None:
        """None, or no step at all while the reserved run holds the tokens (KVCacheManager's)."""
        table = self.block_tables.get(request.request_id)
        fits = table is not None and (
            request.num_computed_tokens + num_steps <= len(table) * self.block_size
        )
        return range(0) if fits else None

    def free(self, request: Request) -> None:
        """Return the request's run to the buddy allocator."""
        rid = request.request_id
        if self.block_tables.pop(rid, None) is not None:
            self.buddy.free(self._run_start.pop(rid))
            self._run_len.pop(rid)

    def memory_breakdown(self, requests: Iterable[Request]) -> MemoryBreakdown:
        """Token states, still-to-be-used reservation, never-used reservation, and the rest."""
        token_states = reservation = internal = 0
        for req in requests:
            if req.request_id not in self.block_tables:
                continue
            reserved = self.reserved_tokens(req)
            final = req.max_total_tokens
            token_states += req.num_tokens
            reservation += max(0, min(reserved, final) - req.num_tokens)
            internal += max(0, reserved - final)
        return MemoryBreakdown(
            token_states=token_states,
            reservation=reservation,
            internal_fragmentation=internal,
            external_fragmentation=self.num_slots - token_states - reservation - internal,
        )


class OrcaMaxKVCacheManager(ReservationKVCacheManager):
    """Orca (Max): every request reserves max_model_len slots."""

    name = "orca_max"

    def reserved_tokens(self, request: Request) -> int:
        """max_model_len, whatever the request."""
        return self.max_model_len


class OrcaPow2KVCacheManager(ReservationKVCacheManager):
    """Orca (Pow2): prompt plus the next power of two of the true output length."""

    name = "orca_pow2"

    def reserved_tokens(self, request: Request) -> int:
        """prompt + 2**ceil(log2(output length))."""
        out = 1 << ceil_log2(request.max_output_tokens)
        return min(self.max_model_len, request.num_prompt_tokens + out)


class OrcaOracleKVCacheManager(ReservationKVCacheManager):
    """Orca (Oracle): prompt plus exactly the true output length (max_tokens with ignore_eos)."""

    name = "orca_oracle"

    def reserved_tokens(self, request: Request) -> int:
        """prompt + max output tokens."""
        return request.max_total_tokens


class StaticBatchKVCacheManager(OrcaMaxKVCacheManager):
    """FasterTransformer-style static batching: max-length reservations, and the next batch
    starts only when the previous one has fully finished (batch size = what fits the pool)."""

    name = "static"
    static_batching = True
