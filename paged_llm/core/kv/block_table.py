"""Block-table entries of the paged policy: a sliding window leaves NULL_BLOCK where a freed
block was (no torch)."""

from __future__ import annotations

# A block-table entry whose block fell out of the sliding window and went back to the pool.
# Such entries are a prefix of the table; kernels never read them (the runner writes block 0
# in their place). Keeping the entry keeps logical block i at table index i.
NULL_BLOCK = -1


def live_blocks(table: list[int]) -> list[int]:
    """The real block ids of a table (without the NULL_BLOCK entries of a sliding window)."""
    return [b for b in table if b != NULL_BLOCK]
