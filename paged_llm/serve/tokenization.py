"""Tokenization off the engine loop: prompts are rendered (chat template, tokenizer) on worker
threads with their own copies of the tokenizer, as vLLM's async tokenization does, so a large
prompt never stalls the engine's steps; a prompt whose length alone proves it cannot fit the
context is refused before it is tokenized at all.

The proof: for the tokenizers where it holds (``max_chars_per_token``), every token covers at
most ``L`` characters of the text, so a text of ``c`` characters has at least ``ceil(c / L)``
tokens. ``L`` comes from the tokenizer's own vocabulary, not a guess.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from paged_llm.serve.errors import APIError, BadRequest

logger = logging.getLogger(__name__)

# normalizers that never make a text shorter (the bound counts the text before normalizing)
_LENGTH_KEEPING_NORMALIZERS = ("Prepend", "Replace")


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of input text one token of ``tokenizer`` can cover, or None where
    no such bound holds or it cannot be read (then nothing is refused early).

    It holds for a BPE model that can spell every character (a byte-level BPE whose vocabulary
    has all 256 byte symbols, or a BPE with byte fallback), so no run of text vanishes or
    becomes one unknown token, and whose normalizer never shortens the text: a byte-level token
    covers as many bytes as its vocabulary string has characters (and bytes >= characters), a
    byte-fallback piece as many characters as it has. Added tokens (``<s>``) cover their own
    text.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # a backend that cannot describe itself: no bound
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    if model.get("type") != "BPE" or not _keeps_length(spec.get("normalizer")):
        return None
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if byte_level:
        from tokenizers import pre_tokenizers

        if not set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys():
            return None  # a byte it cannot spell would be dropped
    elif not model.get("byte_fallback"):
        return None
    pieces = [*vocab, *(t.get("content", "") for t in spec.get("added_tokens") or [])]
    return max(map(len, pieces), default=0) or None


def _keeps_length(normalizer: dict[str, Any] | None) -> bool:
    """True if ``normalizer`` (tokenizers' JSON) never makes a text shorter."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_length(n) for n in normalizer.get("normalizers") or [])
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        return pattern is not None and len(normalizer.get("content", "")) >= len(pattern)
    return kind in _LENGTH_KEEPING_NORMALIZERS


class LengthGuardedTokenizer:
    """A tokenizer whose ``encode`` (and call) first refuses a text that has, provably, more
    than ``max_tokens`` tokens; everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Any, max_tokens: int | None, chars_per_token: int | None):
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        self._chars_per_token = chars_per_token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped ``encode``, after the length proof (a BadRequest if it fails)."""
        if isinstance(text, str):
            self.check_length(text)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __call__(self, *texts: Any, **kwargs: Any) -> Any:
        """The wrapped ``tokenizer(text, text_pair=...)``, after the length proof of each text
        (a pair has at least as many tokens as either part)."""
        for text in (*texts, kwargs.get("text"), kwargs.get("text_pair")):
            if isinstance(text, str) and not kwargs.get("truncation"):
                self.check_length(text)
        return self._tokenizer(*texts, **kwargs)

    def check_length(self, text: str) -> None:
        """A BadRequest if ``text`` has more than ``max_tokens`` tokens by its length alone."""
        if self._max_tokens is None or self._chars_per_token is None:
            return
        at_least = math.ceil(len(text) / self._chars_per_token)
        if at_least > self._max_tokens:
            raise BadRequest(
                f"the prompt has at least {at_least} tokens ({len(text)} characters, at most "
                f"{self._chars_per_token} per token of this tokenizer), more than this model's "
                f"maximum context length of {self._max_tokens} tokens",
                param="prompt",
            )


class TokenizerPool:
    """Worker threads, each with its own copy of the tokenizer (the engine thread keeps the
    original for detokenizing steps; no tokenizer is shared between threads): they render
    prompts and run /tokenize and /detokenize. Several workers, so one long tokenization (the
    tokenizer releases the GIL while it works) never holds up the requests behind it."""

    def __init__(self, tokenizer: Any, max_model_len: int, threads: int = 4) -> None:
        if threads < 1:
            raise ValueError(f"the tokenizer pool needs at least one thread, got {threads}")
        self._original = tokenizer
        self.max_model_len = max_model_len
        self.chars_per_token = max_chars_per_token(tokenizer)
        self._local = threading.local()
        self._copying = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenizer")

    def tokenizer(self) -> Any:
        """This worker thread's tokenizer (a copy made on its first use; None: no tokenizer)."""
        if self._original is None:
            return None
        own = getattr(self._local, "tokenizer", None)
        if own is None:
            with self._copying:
                own = self._local.tokenizer = copy.deepcopy(self._original)
        return own

    def guarded(self, check_length: bool = True) -> Any:
        """This worker's tokenizer, refusing texts longer than the context (``check_length``
        False: as it is, e.g. for a prompt that is truncated to its last tokens)."""
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return None
        limit = self.max_model_len if check_length else None
        return LengthGuardedTokenizer(tokenizer, limit, self.chars_per_token)

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a worker thread; its APIError reaches the caller, any other
        exception as a BadRequest (a tokenizer or template refusing the input)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except APIError:
            raise
        except Exception as err:
            logger.info("tokenization failed: %r", err)
            raise BadRequest(f"could not process the prompt: {err}") from None

    def shutdown(self) -> None:
        """Stop the worker threads (work already running finishes)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
