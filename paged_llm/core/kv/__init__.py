"""KV cache managers: how each policy maps requests onto the pool of blocks (no torch)."""

from paged_llm.core.kv.base import KVCacheManager, MemoryBreakdown
from paged_llm.core.kv.paged import PagedKVCacheManager
from paged_llm.core.kv.reservation import (
    OrcaMaxKVCacheManager,
    OrcaOracleKVCacheManager,
    OrcaPow2KVCacheManager,
    ReservationKVCacheManager,
    StaticBatchKVCacheManager,
)

__all__ = [
    "KVCacheManager",
    "MemoryBreakdown",
    "PagedKVCacheManager",
    "ReservationKVCacheManager",
    "OrcaMaxKVCacheManager",
    "OrcaPow2KVCacheManager",
    "OrcaOracleKVCacheManager",
    "StaticBatchKVCacheManager",
]

POLICIES = {
    "paged": "paged_llm.core.kv.paged.PagedKVCacheManager",
    "orca_max": "paged_llm.core.kv.reservation.OrcaMaxKVCacheManager",
    "orca_pow2": "paged_llm.core.kv.reservation.OrcaPow2KVCacheManager",
    "orca_oracle": "paged_llm.core.kv.reservation.OrcaOracleKVCacheManager",
    "static": "paged_llm.core.kv.reservation.StaticBatchKVCacheManager",
}
