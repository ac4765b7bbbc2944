"""Prompt-lookup drafting: propose the continuation of the most recent earlier occurrence of the
last n tokens (vLLM's ``ngram`` method). Deterministic, so its draft distribution is one-hot."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from paged_llm.spec.base import Drafter

# From this many tokens on, the scan is vectorised: below a few hundred tokens, converting the
# list to an array costs more than the Python scan (`python -m experiments.ngram_scan`,
# docs/speculative.md).
VECTORISE_FROM = 384


def scan_python(tokens: list[int], n: int) -> int | None:
    """Start of the most recent earlier occurrence of the last ``n`` tokens, or None, by a
    Python loop from the right (fast on short contexts)."""
    suffix = tokens[len(tokens) - n :]
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start : start + n] == suffix:
            return start
    return None


def scan_numpy(tokens: np.ndarray, n: int) -> int | None:
    """``scan_python`` vectorised over every window of ``tokens`` [L] (fast on long contexts)."""
    # windows start at 0 .. L - n - 1: every earlier position, never the suffix itself
    windows = sliding_window_view(tokens[:-1], n)
    hits = np.flatnonzero((windows == tokens[len(tokens) - n :]).all(axis=1))
    return int(hits[-1]) if hits.size else None


def match_finder(tokens: list[int]) -> Callable[[int], int | None]:
    """For one proposal: n -> start of the most recent earlier occurrence of the last n tokens
    (None if there is none); a long context is converted to an array once for every n."""
    if len(tokens) >= VECTORISE_FROM:
        return partial(scan_numpy, np.asarray(tokens))
    return partial(scan_python, tokens)


class NgramDrafter(Drafter):
    """Proposes up to k tokens by matching the longest suffix n-gram (max_n down to min_n);
    deterministic, so it needs no KV, no model and no distributions (one-hot q)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int = 4,
                 prompt_lookup_min: int = 1) -> None:  # fmt: skip
        super().__init__(num_speculative_tokens)
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def find_match(self, tokens: list[int], k: int | None = None) -> tuple[list[int], int]:
        """Drafts for one sequence (possibly fewer than k, or none) and the length n of the
        suffix n-gram they continue (0 when nothing matched)."""
        k = self.k if k is None else k
        find = match_finder(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = find(n)
            if start is not None:  # start + n < len(tokens): the continuation is never empty
                return tokens[start + n : start + n + k], n
        return [], 0

    def propose_one(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Drafts for one sequence (possibly fewer than k, or none)."""
        return self.find_match(tokens, k)[0]

    def propose(self, entries: list, sampler: object) -> tuple[dict[str, list[int]], dict]:
        """Drafts per scheduled decode (up to its lookahead); no distributions (one-hot q).
        ``draft_sources`` then names each request's match length ("<n>-gram"), for the
        stats."""
        drafts: dict[str, list[int]] = {}
        self.draft_sources = {}
        for s in entries:
            rid = s.request.request_id
            drafts[rid], n = self.find_match(s.request.all_token_ids, s.num_lookahead)
            self.draft_sources[rid] = f"{n}-gram"
        return drafts, {}
