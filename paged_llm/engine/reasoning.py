"""Reasoning models' thinking (``<think> ... </think>``), split off the way vLLM's
``--reasoning-parser`` does it.

A parser does two jobs:
- ``split``: the server's chat replies carry the thinking as ``reasoning`` and the rest as
  ``content``;
- ``gate``: a structured output (JSON schema, regex, a tool call) constrains only the answer,
  not the thinking: the grammar starts once the reasoning has ended, as in vLLM.

``deepseek_r1`` thinks unprompted: its chat template opens the thought in the prompt, so the
reply is reasoning up to ``</think>``, with or without a ``<think>`` of its own. ``qwen3`` thinks
only when its reply starts with ``<think>`` (``enable_thinking=False`` in the template's
kwargs turns that off); otherwise the whole reply is content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paged_llm.engine.deltas import partial_suffix


@dataclass(frozen=True)
class ReasoningParser:
    """One model family's thinking tags."""

    name: str
    thinks_unprompted: bool  # the reply is reasoning until the end tag even without a start tag
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of a reply so far. Both only grow as text is appended: what
        may still become a tag is held back until the reply has more text or ends."""
        body = text.lstrip()
        if body.startswith(self.start):
            thought_from = len(text) - len(body) + len(self.start)
        elif not finished and self.start.startswith(body):  # blank, or a tag in the making
            return "", ""
        elif self.thinks_unprompted:
            thought_from = 0
        else:
            return "", text
        end_at = text.find(self.end, thought_from)
        if end_at < 0:
            held = 0 if finished else partial_suffix(text[thought_from:], self.end)
            return text[thought_from : len(text) - held], ""
        return text[thought_from:end_at], text[end_at + len(self.end) :]

    def tag_ids(self, tokenizer: Any) -> tuple[int, int]:
        """(start, end) token ids; ValueError unless each tag is one token of the vocabulary
        (the grammar gate watches for them)."""
        ids = []
        for tag in (self.start, self.end):
            encoded = tokenizer.encode(tag, add_special_tokens=False) if tokenizer else []
            if len(encoded) != 1:
                raise ValueError(
                    f"reasoning parser {self.name!r} needs {tag!r} to be one token of the "
                    f"tokenizer's vocabulary (it encodes as {encoded})"
                )
            ids.append(encoded[0])
        return ids[0], ids[1]

    def gate(self, guide: Any, prompt_ids: Sequence[int], tag_ids: tuple[int, int]) -> Any:
        """``guide`` (a grammar) applied only once this request's reasoning has ended."""
        start_id, end_id = tag_ids
        last_start = max((i for i, t in enumerate(prompt_ids) if t == start_id), default=-1)
        last_end = max((i for i, t in enumerate(prompt_ids) if t == end_id), default=-1)
        if last_end > last_start:
            state = AfterReasoning.ANSWERING  # the prompt closed the thought (no thinking)
        elif last_start > last_end or self.thinks_unprompted:
            state = AfterReasoning.THINKING
        else:
            state = AfterReasoning.UNDECIDED
        return AfterReasoning(guide, start_id, end_id, state)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", thinks_unprompted=True),
    "qwen3": ReasoningParser("qwen3", thinks_unprompted=False),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ValueError listing the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


class AfterReasoning:
    """A grammar guide that starts once the reasoning has ended; every token is allowed while
    the model thinks. The same interface as ``structured_output.GrammarGuide``.

    States: THINKING until the end tag; UNDECIDED before a reply that may or may not open with
    the start tag (its first token is the tag or the grammar's); ANSWERING: the grammar rules.
    """

    THINKING, UNDECIDED, ANSWERING = "thinking", "undecided", "answering"

    def __init__(self, guide: Any, start_id: int, end_id: int, state: str):
        self.guide = guide
        self.start_id, self.end_id = start_id, end_id
        self.state = state

    def _next(self, state: str, token: int) -> str:
        if state == self.UNDECIDED:
            return self.THINKING if token == self.start_id else self.ANSWERING
        if state == self.THINKING and token == self.end_id:
            return self.ANSWERING
        return state

    def _grammar_from(self, tokens: Sequence[int]) -> tuple[str, int]:
        """(state after ``tokens``, index of the first of them the grammar sees)."""
        state = self.state
        for i, token in enumerate(tokens):
            if state == self.ANSWERING:
                return state, i
            after = self._next(state, token)
            if after == self.ANSWERING:  # an end tag is not the grammar's; a first token is
                return after, i + (state == self.THINKING)
            state = after
        return state, len(tokens)

    def allowed(self, pending: Sequence[int] = ()) -> torch.Tensor:  # [V] bool
        """Tokens allowed after the accepted ones and then ``pending``."""
        state, i = self._grammar_from(pending)
        if state == self.THINKING:
            return torch.ones(self.guide.vocab_size, dtype=torch.bool)
        mask = self.guide.allowed(list(pending[i:]))
        if state == self.UNDECIDED:
            mask = mask.clone()
            mask[self.start_id] = True  # or start thinking
        return mask

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` are allowed from the current state."""
        state, i = self._grammar_from(tokens)
        if state != self.ANSWERING:
            return len(tokens)
        return i + self.guide.valid_prefix(list(tokens[i:]))

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token."""
        before, self.state = self.state, self._next(self.state, token_id)
        if self.state == self.ANSWERING and before != self.THINKING:
            self.guide.accept(token_id)

    def is_terminated(self) -> bool:
        """True once the answer's grammar is complete."""
        return self.state == self.ANSWERING and self.guide.is_terminated()
