"""vLLM's score pairing (``LLM.score``, ``/v1/score``): which inputs are compared, and each
distinct input embedded once."""

from __future__ import annotations

from typing import Any


def score_pairs(firsts: list[Any], seconds: list[Any]) -> tuple[list[Any], list[tuple[int, int]]]:
    """One input in ``firsts`` is scored against each of ``seconds``; otherwise the two lists are
    paired in order and must be as long. Returns the distinct inputs (text or token ids) and, per
    pair, the indices of its two inputs among them. ValueError when they cannot be paired."""
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not seconds:
        raise ValueError(
            f"score pairs one input with many, or two lists of the same length; got "
            f"{len(firsts)} and {len(seconds)}"
        )
    index: dict[str, int] = {}
    distinct: list[Any] = []

    def slot(prompt: Any) -> int:
        key = repr(prompt)  # text, a list of ids or a prompt dict: repr tells them apart
        if key not in index:
            index[key] = len(distinct)
            distinct.append(prompt)
        return index[key]

    return distinct, [(slot(a), slot(b)) for a, b in zip(firsts, seconds)]
