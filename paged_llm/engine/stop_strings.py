"""Stop strings, checked after every appended token.

The scheduler appends a step's tokens one at a time and asks the request after each whether it
is done (``Request.check_stop``), so a stop string is found at the token that completes it, even
when speculative decoding accepts several tokens in one step: the tokens after it are never
appended, and the output is the one the engine gives without speculation. As in vLLM:

* an occurrence counts only if it ends in text that the newest token added or changed (so it is
  found once, at its last token);
* none counts while the output holds ``min_tokens`` tokens or fewer;
* a stop string ends the request even on its last allowed token (``max_tokens``): the reason is
  "stop", not "length";
* the earliest occurrence wins; the text ends before it, or after it with
  ``include_stop_str_in_output``;
* a token that ends the request by its id (EOS, ``stop_token_ids``) is not searched, and its
  text is left out of the output (``Request.stopped_by_token``) unless
  ``include_stop_str_in_output``.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_llm.engine.output_processor import IncrementalDetokenizer
from paged_llm.sampling_params import SamplingParams


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    n = min(len(a), len(b))
    if b.startswith(a[:n]):  # the usual case: the text only grew
        return n
    return next(i for i in range(n) if a[i] != b[i])


class StopStringChecker:
    """Finds the stop string a sequence's newest token completes, and where its text ends (the
    core asks it as a StopCondition, core/stop_conditions.py)."""

    def __init__(self, detokenizer: IncrementalDetokenizer, params: SamplingParams) -> None:
        self.detokenizer = detokenizer  # the sequence's own: this keeps its text up to date
        self.stop = list(params.stop)
        self.include = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.cut: int | None = None  # once a stop string was found: the text's length

    def __call__(self, output_token_ids: Sequence[int]) -> str | None:
        """Read the newest token; return the stop string it completes, or None."""
        before = self.detokenizer.text
        text = self.detokenizer.update(output_token_ids)
        if len(output_token_ids) <= self.min_tokens:
            return None
        # decoders can rewrite the text's end (a character completed, spaces cleaned up)
        settled = common_prefix_len(before, text)
        hits = []
        for stop in self.stop:
            at = text.find(stop, max(0, settled - len(stop) + 1))
            if at >= 0:
                hits.append((at, stop))
        if not hits:
            return None
        at, stop = min(hits)
        self.cut = at + len(stop) if self.include else at
        return stop
