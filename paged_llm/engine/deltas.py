"""Which part of a running sequence's output is new and can no longer change: the rule shared by
the engine's ``RequestOutputKind.DELTA`` outputs and the server's streamed chunks.

While a sequence runs, the last ``len(longest stop string) - 1`` characters are held back (a
stop string completing later cuts them, as vLLM does), and so is a trailing U+FFFD (a
multi-byte character still being decoded). The decoded text only grows otherwise, so what was
handed out stays a prefix of the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paged_llm.sampling_params import SamplingParams


def stop_holdback(params: SamplingParams) -> int:
    """Characters a running sequence's text holds back for its stop strings."""
    if params.stop and not params.include_stop_str_in_output:
        return max(map(len, params.stop)) - 1
    return 0


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``: held back while streaming,
    as it may yet become the marker (a tool-call or thinking tag)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class DeltaCursor:
    """How much of one sequence's text and tokens has been handed out."""

    sent_chars: int = 0
    sent_tokens: int = 0

    def take(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[Any] | None,  # one entry per token, or None
        finished: bool,
        holdback: int,
    ) -> tuple[str, list[int], list[Any] | None]:
        """(new text, new token ids, their logprobs), and advance past them."""
        end = len(text)
        if not finished:
            end = max(self.sent_chars, end - holdback)
            while end > self.sent_chars and text[end - 1] == "\ufffd":
                end -= 1
        new_logprobs = None if logprobs is None else list(logprobs[self.sent_tokens :])
        new = (text[self.sent_chars : end], list(token_ids[self.sent_tokens :]), new_logprobs)
        self.sent_chars, self.sent_tokens = max(self.sent_chars, end), len(token_ids)
        return new
