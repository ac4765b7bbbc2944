"""vLLM's scoring (``LLM.score``, ``/v1/score``, ``/rerank``), shared by the offline API and the
server: which inputs are compared (each distinct input embedded once), the cosine of two
embeddings, and a cross-encoder's joint input."""

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


def cosine_scores(vectors: list[Any], pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's cosine similarity, from the distinct inputs' unit-length embeddings."""
    return [float(vectors[a] @ vectors[b]) for a, b in pairs]


def check_cross_encoder(num_labels: int, what: str, instead: str) -> None:
    """ValueError unless a classifier asked to score pairs (``what``) has one label, i.e. is a
    cross-encoder; ``instead`` names what classifies with more labels."""
    if num_labels != 1:
        raise ValueError(
            f"{what} with a classifier needs a cross-encoder (one label); this model has "
            f"{num_labels}: use {instead}"
        )


def cross_encoder_input(first: Any, second: Any, tokenizer: Any) -> dict[str, list[int]]:
    """One cross-encoder input from a pair: two texts are tokenized together as a text pair
    (``tokenizer(text, text_pair)``, the model's own pair template); token ids, or a text
    with token ids, are joined first then second."""
    texts = [_text_of(p) for p in (first, second)]
    if tokenizer is None and texts != [None, None]:
        raise ValueError("scoring texts needs a tokenizer; pass token ids instead")
    if None not in texts:
        return {"prompt_token_ids": list(tokenizer(text=texts[0], text_pair=texts[1])["input_ids"])}
    ids = []
    for prompt, text in zip((first, second), texts):
        if text is not None:
            ids += tokenizer(text=text)["input_ids"]
        else:
            ids += list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
    return {"prompt_token_ids": ids}


def _text_of(prompt: Any) -> str | None:
    """The text of a prompt given as text (a string or {"prompt": ...}); None for token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
        return prompt["prompt"]
    return None
