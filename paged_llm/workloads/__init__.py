"""Request workloads for benchmarks and paper reproductions (lengths now; arrivals later)."""

from paged_llm.workloads.lengths import (
    SHAREGPT,
    LengthPair,
    LogNormalLengths,
    filter_total_below,
    load_length_csv,
    sample_pairs,
    scale_to_max_total,
    synthetic_lengths,
)

__all__ = [
    "SHAREGPT",
    "LengthPair",
    "LogNormalLengths",
    "filter_total_below",
    "load_length_csv",
    "sample_pairs",
    "scale_to_max_total",
    "synthetic_lengths",
]
