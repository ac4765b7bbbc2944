"""Structured outputs (vLLM's guided decoding): a grammar masks every token that cannot
continue a valid output, so the text is valid JSON for a schema, matches a regex, is one of a
few choices, or follows an EBNF grammar.

Grammars compile once per (kind, spec) with xgrammar against the model's tokenizer; each
sequence then walks its own matcher. The sampler masks what a request's guide disallows (after
the other logits processors), and every token appended to the request's output advances its
guide. A sequence stops once its grammar is complete (even before ``min_tokens``).

Under speculative decoding, drafts are cut at the first token the grammar rejects, and
verification row i is masked by the grammar's state after drafts 0..i-1 (the matcher accepts
them for a moment and rolls back), so greedy outputs are the same with and without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paged_llm.sampling_params import StructuredOutputsParams


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:  # a declared dependency; this covers installs without it
        raise ValueError(
            "guided decoding needs the 'xgrammar' package (pip install xgrammar)"
        ) from err
    return xgrammar


class GrammarGuide:
    """One sequence's position in its grammar (the core asks it as an OutputConstraint,
    core/stop_conditions.py)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        xgr = _import_xgrammar()
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def allowed(self, pending: Sequence[int] = ()) -> torch.Tensor:  # [V] bool
        """Tokens that keep the output inside the grammar, after the accepted tokens and then
        ``pending`` (tokens not accepted yet, e.g. drafts; they must be valid)."""
        accepted = 0
        for token in pending:
            if self._matcher.is_terminated():
                break  # pending tokens past a stop token: the sequence ends before them
            if not self._matcher.accept_token(token):
                self._matcher.rollback(accepted)
                raise RuntimeError(f"pending token {token} is outside the grammar")
            accepted += 1
        if self._matcher.is_terminated():
            # complete (after a pending stop token): the sequence ends there, so whatever is
            # chosen for this row is never kept
            mask = torch.ones(self.vocab_size, dtype=torch.bool)
        else:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            bits = torch.arange(32, dtype=torch.int32)
            words = (self._bitmask[0, :, None] >> bits) & 1  # [ceil(V / 32), 32]
            mask = words.reshape(-1)[: self.vocab_size].bool()
        if accepted:
            self._matcher.rollback(accepted)
        return mask

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from its current state."""
        n = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (the mask allowed it)."""
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"grammar rejected token {token_id} that its own mask allowed")

    def is_terminated(self) -> bool:
        """True once the output is complete (the stop token was accepted)."""
        return self._matcher.is_terminated()


class StructuredOutputCompiler:
    """Compiles StructuredOutputsParams into guides for one tokenizer (grammars cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None):
        if tokenizer is None:
            raise ValueError("guided decoding needs a tokenizer; this model has none")
        xgr = _import_xgrammar()
        stop = None if eos_token_id is None else [eos_token_id]
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        self._compiler = xgr.GrammarCompiler(info)
        self._xgr = xgr
        self._vocab_size = vocab_size
        self._cache: dict[tuple[str, str], Any] = {}

    def guide(self, params: StructuredOutputsParams) -> GrammarGuide:
        """A fresh guide at the start of ``params``' grammar; ValueError if it does not
        compile (an invalid schema, regex or grammar)."""
        key = params.key()
        compiled = self._cache.get(key)
        if compiled is None:
            try:
                compiled = self._compile(params)
            except Exception as err:  # xgrammar raises RuntimeError / ValueError subclasses
                raise ValueError(f"guided decoding: cannot compile the {key[0]}: {err}") from None
            self._cache[key] = compiled
        return GrammarGuide(self._xgr.GrammarMatcher(compiled), self._vocab_size)

    def _compile(self, p: StructuredOutputsParams) -> Any:
        c = self._compiler
        # Compact JSON: a small model otherwise pads with whitespace it is free to emit.
        if p.json is not None:
            return c.compile_json_schema(p.json_text(), any_whitespace=False)
        if p.json_object:  # OpenAI's json_object mode: some JSON object
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if p.regex is not None:
            return c.compile_regex(p.regex)
        if p.choice is not None:
            return c.compile_regex("|".join(_escape(choice) for choice in p.choice))
        return c.compile_grammar(p.grammar)


def _escape(text: str) -> str:
    """A literal string as a regex (xgrammar's regex dialect is ECMAScript's)."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/" else ch for ch in text)
