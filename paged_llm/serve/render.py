"""Engine updates -> OpenAI response JSON: whole responses, streamed chunks, usage, logprobs.

Streaming sends the text that can no longer change: while a request runs, the last
``len(longest stop string) - 1`` characters are held back (the engine may cut them if a stop
string completes, as vLLM does), and so is a trailing U+FFFD (a multi-byte character still
being decoded). The engine's decoded text only grows otherwise, so sent text stays a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.async_engine import Update

MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass
class Delta:
    """What one update adds to one choice."""

    index: int
    text: str
    logprobs: list[dict[int, float]]  # one entry per new token
    token_ids: list[int]
    first: bool  # the choice's first update (chat sends the role then)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Choice:
    params: SamplingParams
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False

    @property
    def holdback(self) -> int:
        p = self.params
        return max(map(len, p.stop)) - 1 if p.stop and not p.include_stop_str_in_output else 0


class Choices:
    """Progress of every choice of one request."""

    def __init__(self, params: list[SamplingParams], n: int):
        self.choices = [_Choice(p) for p in params]
        self.n = n  # choices per prompt: choice i belongs to prompt i // n
        self.strings: dict[int, str] = {}  # token id -> text, for logprobs

    def apply(self, update: Update) -> Delta:
        """Fold in one update; return the part to stream."""
        c = self.choices[update.index]
        self.strings.update(update.token_strings)
        first, c.started = not c.started, True
        out = update.output
        if out is not None:
            completion = out.outputs[0]
            c.prompt_tokens = len(out.prompt_token_ids)
            c.text, c.token_ids = completion.text, completion.token_ids
            c.logprobs = completion.logprobs or []
            c.finish_reason, c.stop_reason = completion.finish_reason, completion.stop_reason
        if update.aborted:
            c.finish_reason = "abort"
        end = len(c.text)
        if c.finish_reason is None:
            end = max(c.sent_chars, end - c.holdback)
            while end > c.sent_chars and c.text[end - 1] == "\ufffd":
                end -= 1
        delta = Delta(
            index=update.index,
            text=c.text[c.sent_chars : end],
            logprobs=c.logprobs[c.sent_tokens :],
            token_ids=c.token_ids[c.sent_tokens :],
            first=first,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        c.sent_chars, c.sent_tokens = max(c.sent_chars, end), len(c.token_ids)
        return delta

    def usage(self) -> dict[str, int]:
        """OpenAI usage: each prompt counted once, every choice's generated tokens."""
        prompt = sum(
            c.prompt_tokens or 0 for i, c in enumerate(self.choices) if i % self.n == 0
        )  # choices of one prompt share it
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    # ---- logprobs in the two OpenAI formats --------------------------------------------------
    def completion_logprobs(self, delta: Delta, text_offset: int) -> dict[str, Any] | None:
        """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
        if self.choices[delta.index].params.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(delta.token_ids, delta.logprobs):
            s = self.strings.get(tid, "")
            tokens.append(s)
            token_lps.append(_lp(entry.get(tid, MIN_LOGPROB)))
            tops.append({self.strings.get(t, ""): _lp(v) for t, v in entry.items()})
            offsets.append(text_offset)
            text_offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, delta: Delta) -> dict[str, Any] | None:
        """Chat format: one entry per token with its top_logprobs alternatives."""
        k = self.choices[delta.index].params.logprobs
        if k is None:
            return None
        content = []
        for tid, entry in zip(delta.token_ids, delta.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            item = self._token_entry(tid, entry.get(tid, MIN_LOGPROB))
            item["top_logprobs"] = [self._token_entry(t, v) for t, v in top]
            content.append(item)
        return {"content": content}

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self.strings.get(token_id, "")
        return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


# ---- JSON bodies --------------------------------------------------------------------------------
def completion_chunk(
    rid: str, created: int, model: str, choices: Choices, delta: Delta
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    offset = choices.choices[delta.index].sent_chars - len(delta.text)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": delta.index,
                "text": delta.text,
                "logprobs": choices.completion_logprobs(delta, offset),
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
        ],
    }


def chat_chunks(
    rid: str, created: int, model: str, choices: Choices, delta: Delta
) -> list[dict[str, Any]]:
    """Streamed ``chat.completion.chunk``s: the role first, then content."""

    def chunk(content: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": delta.index,
                    "delta": content,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": delta.stop_reason if finish else None,
                }
            ],
        }

    out = []
    if delta.first:
        out.append(chunk({"role": "assistant", "content": ""}, None, None))
    out.append(chunk({"content": delta.text}, choices.chat_logprobs(delta), delta.finish_reason))
    return out


def usage_chunk(rid: str, created: int, model: str, obj: str, choices: Choices) -> dict[str, Any]:
    """The last streamed chunk when ``stream_options.include_usage`` is set."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": choices.usage(),
    }


def whole_response(rid: str, created: int, model: str, choices: Choices, chat: bool) -> dict:
    """A non-streamed response once every choice has finished."""
    items = []
    for i, c in enumerate(choices.choices):
        delta = Delta(i, c.text, c.logprobs, c.token_ids, True, c.finish_reason, c.stop_reason)
        item: dict[str, Any] = {"index": i}
        if chat:
            item["message"] = {"role": "assistant", "content": c.text}
            item["logprobs"] = choices.chat_logprobs(delta)
        else:
            item["text"] = c.text
            item["logprobs"] = choices.completion_logprobs(delta, 0)
        item["finish_reason"] = c.finish_reason
        item["stop_reason"] = c.stop_reason
        items.append(item)
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": items,
        "usage": choices.usage(),
    }
