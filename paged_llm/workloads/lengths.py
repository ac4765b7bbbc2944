"""Request length workloads: (input_len, output_len) pairs from a trace or a synthetic fit.

Plain Python (no torch), so analysis scripts can use it without loading a model. Everything
that draws random numbers takes an explicit seed and uses its own ``random.Random``, so a
workload is reproducible and never disturbs the caller's global RNG.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# The vLLM paper (Kwon et al., SOSP 2023, Sec. 6.1) keeps ShareGPT pairs with
# input_len + output_len < 2048, the context length of its OPT models.
PAPER_MAX_TOTAL = 2048


class LengthPair(NamedTuple):
    """Prompt and output length of one request, in tokens."""

    input_len: int
    output_len: int


@dataclass(frozen=True)
class LogNormalLengths:
    """Independent log-normal input and output lengths with given means and log-space sigmas."""

    name: str
    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float


def _sigma_for_median(mean: float, median: float) -> float:
    """Log-space sigma of the log-normal with this mean and median (mean/median = e^(s^2/2))."""
    return math.sqrt(2.0 * math.log(mean / median))


# Means are the paper's Fig. 11 ShareGPT means (OPT tokenizer); sigmas are chosen so the
# medians match the published length-only trace after the paper's filter (input p50 35,
# output p50 271; see paged_llm/workloads/data/README.md). The input tail is heavy
# (sigma ~1.75), as in the trace, where p90 is 14x the median.
SHAREGPT = LogNormalLengths(
    name="sharegpt",
    input_mean=161.31,
    output_mean=337.99,
    input_sigma=_sigma_for_median(161.31, 35.0),
    output_sigma=_sigma_for_median(337.99, 271.0),
)


def load_length_csv(path: str | Path) -> list[LengthPair]:
    """Read a CSV with ``input_len,output_len`` columns (header required) into pairs."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"input_len", "output_len"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
        return [LengthPair(int(row["input_len"]), int(row["output_len"])) for row in reader]


def filter_total_below(pairs: list[LengthPair], limit: int = PAPER_MAX_TOTAL) -> list[LengthPair]:
    """Keep pairs with input_len + output_len < limit and both lengths >= 1 (the paper's filter)."""
    return [p for p in pairs if p.input_len >= 1 and p.output_len >= 1 and sum(p) < limit]


def sample_pairs(pairs: list[LengthPair], n: int, seed: int) -> list[LengthPair]:
    """Draw n pairs without replacement (with replacement if n exceeds the pool), seeded."""
    if not pairs:
        raise ValueError("cannot sample from an empty list of length pairs")
    rng = random.Random(seed)
    if n <= len(pairs):
        return rng.sample(pairs, n)
    return rng.choices(pairs, k=n)


def _lognormal_int(rng: random.Random, mean: float, sigma: float) -> int:
    """One log-normal draw with the given mean, rounded to a token count >= 1."""
    mu = math.log(mean) - sigma * sigma / 2.0  # E[X] = exp(mu + sigma^2 / 2)
    return max(1, round(rng.lognormvariate(mu, sigma)))


def synthetic_lengths(n: int, seed: int, dist: LogNormalLengths = SHAREGPT) -> list[LengthPair]:
    """n independent (input_len, output_len) draws from a log-normal length model, seeded."""
    rng = random.Random(seed)
    return [
        LengthPair(
            _lognormal_int(rng, dist.input_mean, dist.input_sigma),
            _lognormal_int(rng, dist.output_mean, dist.output_sigma),
        )
        for _ in range(n)
    ]


def scale_to_max_total(pairs: list[LengthPair], max_total: int) -> list[LengthPair]:
    """Shrink pairs whose total exceeds max_total by one common factor (keeping the
    input/output ratio), rounding down and keeping each length >= 1; shorter pairs pass as is."""
    if max_total < 2:
        raise ValueError(
            f"max_total must be at least 2 (one input and one output token), got {max_total}"
        )
    return [_scale_pair(p, max_total) for p in pairs]


def _scale_pair(pair: LengthPair, max_total: int) -> LengthPair:
    total = pair.input_len + pair.output_len
    if total <= max_total:
        return pair
    factor = max_total / total
    inp = max(1, math.floor(pair.input_len * factor))
    out = max(1, math.floor(pair.output_len * factor))
    # Raising a side to 1 can push the sum one over; take the excess from the longer side.
    excess = inp + out - max_total
    if excess > 0:
        if inp >= out:
            inp -= excess
        else:
            out -= excess
    return LengthPair(inp, out)
