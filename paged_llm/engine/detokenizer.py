"""Incremental detokenization: a sequence's text grows by decoding only its newest tokens.

Decoding the whole output again at every step costs O(length) per step, O(length^2) per request
(on the tiny model, 64 requests of 1,000 tokens spent 44% of their time in it). Like vLLM, each
sequence instead keeps the text up to an anchor token and decodes only the window from the
anchor on. The anchor is the newest token whose text, and all text before it, no later token
can change: not a byte-fallback token <0xNN> (a run of those decodes as one byte string, and one
invalid byte turns every byte of the run into U+FFFD), and not one that ends in a multi-byte
character still being decoded. Starting the window at the anchor, not after it, lets decoders
that treat a string's first token differently (dropping SentencePiece's leading space) do the
same to the window's first token as to the anchor alone, so the difference is exact.

The text equals ``tokenizer.decode(ids, skip_special_tokens=...)`` after every update,
including a trailing U+FFFD while a character is incomplete (tests/test_detokenizer.py checks
this on byte-level and SentencePiece-style tokenizers). Should a decoder not fit this scheme
(the window does not begin with the anchor's text), it decodes everything once and starts over.
Where exactness cannot be guaranteed (slow Python tokenizers, whose
``spaces_between_special_tokens`` joins tokens differently, and tokenizers that clean up spaces
around punctuation after decoding) it decodes everything at every step. What a tokenizer allows
(``tokenizer_facts``) and the engine's keeper of texts (``TokenTexts``) are engine/token_texts.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_llm.engine.token_texts import TokenizerFacts


class IncrementalDetokenizer:
    """The text of one sequence's growing list of output token ids."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        facts: TokenizerFacts | None = None,  # tokenizer_facts(tokenizer); None: decode it all
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.skip = facts.special_ids if facts and skip_special_tokens else frozenset()
        self.byte_ids = facts.byte_ids if facts else frozenset()
        self.rust_decode = facts.decode if facts else None
        self.ids: list[int] = []  # the ids fed so far, without the skipped specials
        self.num_read = 0  # output ids consumed
        # The window decoded each step starts at the anchor, the last token whose text (and all
        # text before it) no later token can change; before there is one, at the first token.
        self.anchor: int | None = None
        self.stable = ""  # decode(ids[: anchor + 1])
        self.anchor_text = ""  # decode([ids[anchor]]), the window's known beginning
        self.text = ""

    @property
    def incremental(self) -> bool:
        """Whether windows are decoded (else the whole output, every step)."""
        return self.rust_decode is not None

    def update(self, output_ids: Sequence[int]) -> str:
        """Take ``output_ids[num_read:]`` (the tokens new since the last call); return the
        whole text, ``tokenizer.decode(output_ids)``."""
        if len(output_ids) == self.num_read:  # read already (stop strings read token by token)
            return self.text
        new = output_ids[self.num_read :]
        self.num_read = len(output_ids)
        if not self.incremental:
            self.text = self.tokenizer.decode(
                list(output_ids),
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
            )
            return self.text
        self.ids.extend(t for t in new if t not in self.skip)
        start = 0 if self.anchor is None else self.anchor
        window = self._decode(self.ids[start:])
        if not window.startswith(self.anchor_text):  # a decoder this scheme does not fit
            self.anchor, self.stable, self.anchor_text, start = None, "", "", 0
            window = self._decode(self.ids)
        self.text = self.stable + window[len(self.anchor_text) :]
        self._move_anchor(start)
        return self.text

    def _move_anchor(self, start: int) -> None:
        """Anchor the window at the newest token that ends a settled text: not a byte-fallback
        token (a later byte can join its run), and not ending in a partial character."""
        lowest = start if self.anchor is None else start + 1
        q = len(self.ids) - 1
        while q >= lowest and self.ids[q] in self.byte_ids:
            q -= 1
        if q < lowest:
            return
        if q == len(self.ids) - 1:
            through = self.text
        else:
            through = self.stable + self._decode(self.ids[start : q + 1])[len(self.anchor_text) :]
        if through.endswith("\ufffd"):  # a multi-byte character still being decoded
            return
        self.anchor, self.stable = q, through
        self.anchor_text = self._decode(self.ids[q : q + 1])

    def _decode(self, ids: Sequence[int]) -> str:
        """Text of a window of fed ids (which hold no skipped special ids)."""
        return self.rust_decode(list(ids), skip_special_tokens=False)
