"""What a KV cache manager reports (plain Python, no torch): the paper's split of its pool, and
its own prefix-cache and offload counters. Read by the simulators' figures and the metrics,
never by a step itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryBreakdown:
    """The paper's Fig. 2 split of the KV pool, in token slots; the four parts sum to the pool."""

    token_states: int  # prompt + generated-so-far tokens of live requests
    reservation: int  # reserved for tokens the request will still generate
    internal_fragmentation: int  # reserved or allocated, never to be used
    external_fragmentation: int  # everything else: free space, allocator rounding

    @property
    def total(self) -> int:
        """Pool size in slots."""
        return (
            self.token_states
            + self.reservation
            + self.internal_fragmentation
            + self.external_fragmentation
        )

    def shares(self) -> dict[str, float]:
        """Each part as a fraction of the pool."""
        t = self.total or 1
        return {
            "token_states": self.token_states / t,
            "reservation": self.reservation / t,
            "internal_fragmentation": self.internal_fragmentation / t,
            "external_fragmentation": self.external_fragmentation / t,
        }


@dataclass(frozen=True)
class KVCacheStats:
    """A KV manager's own counters, in blocks: prefix-cache lookups and, with a CPU tier,
    blocks copied out to it and back."""

    prefix_caching: bool  # prefix caching is on (lookups also count a KV connector's loads)
    prefix_queries: int  # full prompt blocks looked up
    prefix_hits: int  # of which found (on the device, in the CPU tier or the connector's store)
    offload: tuple[int, int] | None = None  # CPU tier: (copied out, copied back); None: no tier
    offload_blocks: int = 0  # the CPU tier's size

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt blocks that were found (0 before any lookup)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
