"""Engine updates -> OpenAI response JSON: whole responses, streamed chunks, usage, logprobs.

Streaming sends the text that can no longer change (``engine/deltas.py``: held back while a
stop string may still complete or a multi-byte character is being decoded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.engine.deltas import DeltaCursor, stop_holdback
from paged_llm.outputs import CompletionOutput, LogprobEntry, RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.async_engine import Update
from paged_llm.serve.replies import ChatReply, ChatReplyStream

MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass
class Delta:
    """What one update adds to one choice."""

    index: int
    text: str
    logprobs: list[LogprobEntry | None]  # one entry per new token (None: a prompt's first)
    token_ids: list[int]
    first: bool  # the choice's first update (chat sends the role then)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    start: int = 0  # position of token_ids[0] in the choice's tokens (an echoed prompt's first)


@dataclass
class _Choice:
    params: SamplingParams
    text: str = ""
    sent: DeltaCursor = field(default_factory=DeltaCursor)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False
    # completions' echo: the prompt leads text, token ids and logprobs; prompt_only drops the
    # generated part (echo with max_tokens=0)
    echo: bool = False
    prompt_only: bool = False
    num_prompt_tokens: int = 0  # of token_ids, when echoed
    reply_stream: ChatReplyStream | None = None  # chat with tools or reasoning


class Choices:
    """Progress of every choice of one request: ``n`` per engine request (prompt)."""

    def __init__(
        self,
        params: list[SamplingParams],
        echo: bool = False,  # show each prompt (text, tokens, logprobs) before its choices
        prompt_only: bool = False,
        reply: ChatReply | None = None,  # chat: reasoning and tool calls in the replies
        return_token_ids: bool = False,  # vLLM's: prompt and output token ids in the JSON
    ):
        if len({p.n for p in params}) > 1:
            raise ValueError("every prompt of a request has the same n")
        self.n = params[0].n if params else 1  # choice i belongs to prompt i // n
        self.reply = reply
        self.return_token_ids = return_token_ids
        self.choices = [_Choice(p, echo=echo, prompt_only=prompt_only,
                                reply_stream=reply.stream() if reply else None)
                        for p in params for _ in range(p.n)]  # fmt: skip
        self.prompt_ids: dict[int, list[int]] = {}  # engine request index -> its prompt's ids
        self.cached_tokens: dict[int, int] = {}  # ... -> its prompt tokens from the prefix cache
        # engine request index -> its prompt's logprobs (SamplingParams.prompt_logprobs)
        self.prompt_logprobs: dict[int, list[LogprobEntry | None]] = {}
        self.strings: dict[int, str] = {}  # token id -> text, for logprobs

    def apply(self, update: Update) -> list[Delta]:
        """Fold in one engine request's update; return what to stream, per changed choice."""
        self.strings.update(update.token_strings)
        base = update.index * self.n
        changed = set()
        out = update.output
        if out is not None:
            self.prompt_ids[update.index] = out.prompt_token_ids
            self.cached_tokens[update.index] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                self.prompt_logprobs[update.index] = out.prompt_logprobs
            for completion in out.outputs:
                if self._fold(self.choices[base + completion.index], completion, out):
                    changed.add(base + completion.index)
        if update.aborted:  # the abort cut short every sample still running
            for i in range(base, base + self.n):
                if self.choices[i].finish_reason is None:
                    self.choices[i].finish_reason = "abort"
                    changed.add(i)
        return [self._delta(i) for i in sorted(changed)]

    @staticmethod
    def _fold(c: _Choice, completion: CompletionOutput, out: RequestOutput) -> bool:
        """Copy one sample's cumulative state; True if it has new tokens or just finished.

        The engine reports every sample of a request whenever any of them progressed; the
        unchanged ones (waiting to fork, or finished earlier) must not stream empty chunks.
        """
        text, token_ids = completion.text, list(completion.token_ids)
        logprobs: list[LogprobEntry | None] = list(completion.logprobs or [])
        if c.prompt_only:
            text, token_ids, logprobs = "", [], []
        if c.echo:
            c.num_prompt_tokens = len(out.prompt_token_ids)
            text = (out.prompt or "") + text
            token_ids = list(out.prompt_token_ids) + token_ids
            logprobs = list(out.prompt_logprobs or [None] * c.num_prompt_tokens) + logprobs
        progressed = len(token_ids) > len(c.token_ids)
        finishing = c.finish_reason is None and completion.finish_reason is not None
        c.text, c.token_ids, c.logprobs = text, token_ids, logprobs
        c.finish_reason, c.stop_reason = completion.finish_reason, completion.stop_reason
        return progressed or finishing

    def _delta(self, index: int) -> Delta:
        """The not yet streamed part of one choice that can no longer change."""
        c = self.choices[index]
        first, c.started = not c.started, True
        finished = c.finish_reason is not None
        start = c.sent.sent_tokens
        text, token_ids, logprobs = c.sent.take(
            c.text, c.token_ids, c.logprobs, finished, stop_holdback(c.params)
        )
        return Delta(
            index=index,
            text=text,
            logprobs=logprobs or [],
            token_ids=token_ids,
            first=first,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            start=start,
        )

    def prompt_token_ids(self, index: int) -> list[int] | None:
        """Choice ``index``'s prompt ids when the request asked for token ids (else None)."""
        return self.prompt_ids.get(index // self.n) if self.return_token_ids else None

    def output_token_ids(self, delta: Delta) -> list[int] | None:
        """The delta's generated token ids (an echoed prompt's are not among them) when the
        request asked for token ids (else None)."""
        if not self.return_token_ids:
            return None
        echoed = max(0, self.choices[delta.index].num_prompt_tokens - delta.start)
        return delta.token_ids[echoed:]

    def usage(self) -> dict[str, int]:
        """OpenAI usage: each prompt counted once, every choice's generated tokens."""
        prompt = sum(map(len, self.prompt_ids.values()))  # the n choices of a prompt share it
        completion = sum(len(c.token_ids) - c.num_prompt_tokens for c in self.choices)
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
            if entry is None:  # an echoed prompt's first token has no logprob
                token_lps.append(None)
                tops.append(None)
            else:
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

    def prompt_logprobs_json(self, index: int) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs`` of choice ``index``'s prompt: per prompt token (None for
        the first), token id -> logprob, rank and decoded text; None if not asked for."""
        entries = self.prompt_logprobs.get(index // self.n)
        if entries is None:
            return None
        return [
            None
            if entry is None
            else {
                str(t): {"logprob": _lp(v), "rank": v.rank, "decoded_token": v.decoded_token}
                for t, v in entry.items()
            }
            for entry in entries
        ]

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
    offset = choices.choices[delta.index].sent.sent_chars - len(delta.text)
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
                **_token_ids(choices, delta, with_prompt=delta.first),
            }
        ],
    }


def _token_ids(choices: Choices, delta: Delta, with_prompt: bool) -> dict[str, Any]:
    """vLLM's ``return_token_ids`` fields of one completion choice: ``token_ids`` (new ones, in
    a stream), with ``prompt_token_ids`` too if ``with_prompt`` (a stream's first chunk)."""
    if not choices.return_token_ids:
        return {}
    out: dict[str, Any] = {"token_ids": choices.output_token_ids(delta)}
    if with_prompt:
        out["prompt_token_ids"] = choices.prompt_token_ids(delta.index)
    return out


def chat_chunks(
    rid: str, created: int, model: str, choices: Choices, delta: Delta
) -> list[dict[str, Any]]:
    """Streamed ``chat.completion.chunk``s: the role first, then content."""

    def chunk(
        content: dict[str, Any],
        logprobs: Any,
        finish: str | None,
        token_ids: list[int] | None = None,  # None: not asked for (return_token_ids)
        prompt_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": delta.index,
            "delta": content,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": delta.stop_reason if finish else None,
        }
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        if prompt_ids is not None:
            body["prompt_token_ids"] = prompt_ids
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**body, "choices": [choice]}

    out = []
    if delta.first:  # the role; vLLM's prompt ids ride on a stream's first chunk
        prompt_ids = choices.prompt_token_ids(delta.index)
        out.append(chunk({"role": "assistant", "content": ""}, None, None, None, prompt_ids))
    body: dict[str, Any] = {"content": delta.text}
    finish = delta.finish_reason
    stream = choices.choices[delta.index].reply_stream
    if stream is not None:
        body = stream.feed(delta.text, finished=finish is not None)
        finish = stream.finish_reason(finish)
    out.append(chunk(body, choices.chat_logprobs(delta), finish, choices.output_token_ids(delta)))
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
        finish = c.finish_reason
        if chat:
            item["message"] = {"role": "assistant", "content": c.text}
            if choices.reply is not None:
                item["message"], finish = choices.reply.message(c.text, finish)
            item["logprobs"] = choices.chat_logprobs(delta)
        else:
            item["text"] = c.text
            item["logprobs"] = choices.completion_logprobs(delta, 0)
        item["finish_reason"] = finish
        item["stop_reason"] = c.stop_reason
        if not chat:  # each choice carries its own prompt's (a request may have several)
            item["prompt_logprobs"] = choices.prompt_logprobs_json(i)
        item.update(_token_ids(choices, delta, with_prompt=not chat))
        items.append(item)
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": items,
        "usage": choices.usage(),
    }
    if chat:  # one conversation, so one prompt for every choice (vLLM's top-level fields)
        body["prompt_logprobs"] = choices.prompt_logprobs_json(0)
        if choices.return_token_ids:
            body["prompt_token_ids"] = choices.prompt_token_ids(0)
    return body
