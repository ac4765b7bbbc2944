"""The benchmarks' requests: ShareGPT-shaped lengths (a trace or the synthetic fit), scaled to
a maximum total length, with random prompt token ids."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from paged_llm.workloads import lengths as wl


@dataclass
class Workload:
    """Prompt token ids and the output length each request must produce."""

    prompts: list[list[int]]
    output_lens: list[int]
    source: str  # "trace:<path>" or "synthetic"

    @property
    def input_tokens(self) -> int:
        """Total prompt tokens."""
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        """Total requested output tokens."""
        return sum(self.output_lens)

    def head(self, n: int, max_tokens: int | None = None) -> Workload:
        """The first n requests, outputs capped at max_tokens if given (for warm-up runs)."""
        outs = [o if max_tokens is None else min(o, max_tokens) for o in self.output_lens[:n]]
        return Workload(self.prompts[:n], outs, self.source)


def length_pairs(
    num_requests: int,
    seed: int,
    trace: str | Path | None = None,
    filter_total_below: int = wl.PAPER_MAX_TOTAL,
    synthetic: wl.LogNormalLengths = wl.SHAREGPT,
) -> tuple[list[wl.LengthPair], str]:
    """(input_len, output_len) pairs sampled from the trace CSV (filtered as the paper does) or
    drawn from the synthetic fit, before scaling; and their source label."""
    if trace:
        pool = wl.filter_total_below(wl.load_length_csv(trace), filter_total_below)
        return wl.sample_pairs(pool, num_requests, seed), f"trace:{trace}"
    return wl.synthetic_lengths(num_requests, seed, synthetic), "synthetic"


def random_prompt_workload(
    pairs: list[wl.LengthPair], source: str, vocab_size: int, max_total: int, seed: int
) -> Workload:
    """Scale the pairs to ``max_total`` tokens, then draw random prompt token ids."""
    pairs = wl.scale_to_max_total(pairs, max_total)
    rng = random.Random(seed + 1)  # its own stream: changing lengths keeps ids reproducible
    prompts = [[rng.randrange(vocab_size) for _ in range(p.input_len)] for p in pairs]
    return Workload(prompts, [p.output_len for p in pairs], source)


def build_workload(
    num_requests: int, vocab_size: int, max_total: int, trace: str | None = None, seed: int = 0
) -> Workload:
    """ShareGPT-shaped lengths (the trace, or the synthetic log-normal fit), random prompt ids."""
    pairs, source = length_pairs(num_requests, seed, trace)
    return random_prompt_workload(pairs, source, vocab_size, max_total, seed)
