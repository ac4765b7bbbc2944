"""The engine's tokenizer side, shared by its input and output processing: what incremental
detokenization needs to know of a tokenizer (``tokenizer_facts``, once per engine), each
sequence's text keeper (``IncrementalDetokenizer``, engine/output_processor.py), and each
token's own text, decoded once."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from paged_llm.engine.output_processor import IncrementalDetokenizer


@dataclass(frozen=True)
class TokenizerFacts:
    """What incremental decoding needs to know about a tokenizer (computed once per engine)."""

    special_ids: frozenset[int]  # what decode(skip_special_tokens=True) drops
    # byte-fallback tokens <0xNN> (SentencePiece-style): a run of them decodes as one byte
    # string, and one invalid byte turns every byte of the run into U+FFFD
    byte_ids: frozenset[int]
    # the Rust tokenizer's own decode: what the transformers wrapper calls when it cleans up
    # nothing, without its per-call Python overhead (most of the cost of a short window)
    decode: Any


def tokenizer_facts(tokenizer: Any) -> TokenizerFacts | None:
    """The facts of a fast tokenizer; None where incremental decoding would not be exact."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    added = backend.get_added_tokens_decoder()
    special = frozenset(i for i, token in added.items() if token.special)
    byte_ids: frozenset[int] = frozenset()
    if "ByteFallback" in json.dumps(json.loads(backend.to_str()).get("decoder")):
        byte_ids = frozenset(
            i for tok, i in backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(tok)
        )
    return TokenizerFacts(special, byte_ids, backend.decode)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenTexts:
    """The engine's tokenizer side, shared by its input and output processing: each sequence's
    text keeper, and each token's own text (logprobs' ``decoded_token``), decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # None: no text (no tokenizer, or skip_tokenizer_init)
        # how incremental detokenization reads it; None: every sequence decodes its whole text
        self.facts = None if tokenizer is None else tokenizer_facts(tokenizer)
        self._texts: dict[int, str] = {}

    def detokenizer_for(self, params: Any) -> IncrementalDetokenizer | None:
        """A sequence's text keeper for its SamplingParams, or None when it has no text."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                      params.spaces_between_special_tokens, self.facts)  # fmt: skip

    def token_text(self, token_id: int) -> str:
        """One token's own text (needs a tokenizer); decoded once per vocabulary entry, ever."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def name_tokens(self, entry: dict[int, Any], params: Any) -> None:
        """Fill each Logprob's ``decoded_token`` (the token's own text), as vLLM does."""
        if self.tokenizer is not None and params.detokenize:
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.token_text(token_id)


def eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    """The tokenizer's EOS id, else the model config's (the first of a list)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos
