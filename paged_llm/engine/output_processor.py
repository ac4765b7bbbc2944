"""From a step's sampled tokens to vLLM's RequestOutputs: logprobs, incremental text, stop
strings' cut, streaming deltas, parallel samples. It is also the plug-in that forks a
request's waiting samples off its first one once that one's prompt has run. Each sequence's
text grows by incremental detokenization (``IncrementalDetokenizer``, at the end)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from paged_llm.engine.core import EnginePlugin, StepState
from paged_llm.engine.deltas import stop_holdback
from paged_llm.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from paged_llm.sampling_params import RequestOutputKind

if TYPE_CHECKING:  # annotations only: these modules import the detokenizer from here
    from paged_llm.engine.request_group import RequestGroup, Tracked
    from paged_llm.engine.token_texts import TokenizerFacts, TokenTexts


class OutputProcessor(EnginePlugin):
    """The engine's user requests beside the scheduler, and the outputs each step makes."""

    def __init__(self, scheduler: Any, texts: TokenTexts) -> None:
        self.scheduler = scheduler
        self.texts = texts
        self.groups: dict[str, RequestGroup] = {}  # user request id -> its samples
        self.seqs: dict[str, tuple[RequestGroup, Tracked]] = {}  # sequence id -> (group, state)

    def add(self, group: RequestGroup) -> None:
        """Queue a validated group. With a sharing policy, samples 2..n wait for the first one's
        prefill and then fork its blocks; otherwise each sample is an independent request."""
        first, rest = group.members[0], group.members[1:]
        self.scheduler.add_request(first.request)
        if self.scheduler.kv.supports_sharing:
            group.unforked = list(rest)
        else:
            for t in rest:
                self.scheduler.add_request(t.request)
        self.groups[group.request_id] = group
        for t in group.members:
            self.seqs[t.request.request_id] = (group, t)

    def before_forward(self, step: StepState) -> None:
        """Fork waiting samples off a first sample whose prefill completes in this step."""
        for s in step.out.scheduled:
            entry = self.seqs.get(s.request.request_id)
            if entry is None or not entry[0].unforked or not s.samples:
                continue
            group, first = entry
            for t in group.unforked:
                self.scheduler.fork_sample(first.request, t.request)
            group.unforked = []

    def pop(self, request_id: str) -> RequestGroup | None:
        """Stop tracking a user request (finished or aborted); its group, if it had one."""
        group = self.groups.pop(request_id, None)
        for t in group.members if group is not None else []:
            self.seqs.pop(t.request.request_id, None)
        return group

    def outputs(self, step: StepState) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs of the requests this step advanced (the engine releases finished ones)."""
        for rid, (first, entries) in step.prompt_logprobs.items():
            if rid not in self.seqs:  # aborted since (async output processing)
                continue
            group = self.seqs[rid][0]  # recomputed after preemption: the same values again
            for entry in entries:
                self.texts.name_tokens(entry, group.members[0].request.sampling_params)
            group.prompt_logprobs[first : first + len(entries)] = entries
        touched: dict[str, RequestGroup] = {}
        for rid, data in step.pooled.items():  # pooling requests whose prompt this step ran
            entry = self.seqs.get(rid)
            if entry is not None:
                entry[0].pooled = data
                touched[entry[0].request_id] = entry[0]
        for rid, result in step.results.items():
            entry = self.seqs.get(rid)
            if entry is None:
                continue
            group, tracked = entry
            self._record_logprobs(tracked, result)
            self._detokenize(tracked)
            touched[group.request_id] = group
        outputs = [self._output(group) for group in touched.values()]
        return [o for o in outputs if o is not None]  # None: FINAL_ONLY, still running

    def _record_logprobs(self, tracked: Tracked, result: Any) -> None:
        """Add the logprobs of the step's tokens that joined the output: a speculative step
        has several, and a stop (or an abort) may have ended the step early."""
        if result.logprobs is None:  # the sampler computes them when the request tracks them
            return
        kept = min(len(tracked.request.output_token_ids) - tracked.num_scored,
                   len(result.token_ids))  # fmt: skip
        for token, entry in zip(result.token_ids[:kept], result.logprobs[:kept]):
            if tracked.logprobs is not None:
                self.texts.name_tokens(entry, tracked.request.sampling_params)
                tracked.logprobs.append(entry)
            tracked.cumulative_logprob += entry[token]
        tracked.num_scored += kept

    @staticmethod
    def _detokenize(tracked: Tracked) -> None:
        """Update the text: cut at a stop string (found by the scheduler, token by token), and
        without the text of a stop token."""
        if tracked.detokenizer is None:
            return
        req = tracked.request
        ids = req.output_token_ids
        if req.stopped_by_token and not req.sampling_params.include_stop_str_in_output:
            ids = ids[:-1]  # vLLM leaves the stop token's text out
        text = tracked.detokenizer.update(ids)
        if tracked.stop_strings is not None and tracked.stop_strings.cut is not None:
            text = text[: tracked.stop_strings.cut]
        tracked.text = text

    @staticmethod
    def _completion(index: int, tracked: Tracked, delta: bool = False) -> CompletionOutput:
        """One sequence's output: all of it, or (``delta``) what is new since the last one."""
        req = tracked.request
        text, token_ids, logprobs = tracked.text, req.output_token_ids, tracked.logprobs
        if delta:  # take copies only what is new
            holdback = stop_holdback(req.sampling_params)
            text, token_ids, logprobs = tracked.sent.take(
                text, token_ids, logprobs, req.is_finished, holdback
            )
        else:
            token_ids = list(token_ids)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=(
                tracked.cumulative_logprob if req.sampling_params.tracks_logprobs else None
            ),
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=req.status.value if req.is_finished else None,
            stop_reason=req.stop_reason,
        )

    def _delta_completions(self, group: RequestGroup) -> list[CompletionOutput]:
        """DELTA: the samples with new tokens or text, or whose finish is not reported yet."""
        completions = []
        for i, t in enumerate(group.members):
            c = self._completion(i, t, delta=True)
            if c.token_ids or c.text or (c.finish_reason is not None and not t.finish_sent):
                t.finish_sent = c.finish_reason is not None
                completions.append(c)
        return completions

    def _output(self, group: RequestGroup) -> RequestOutput | PoolingRequestOutput | None:
        """The request's output after this step (None: FINAL_ONLY and still running)."""
        first = group.members[0]
        req = first.request
        if req.is_pooling:
            return PoolingRequestOutput(
                request_id=group.request_id, outputs=PoolingOutput(group.pooled),
                prompt_token_ids=req.prompt_token_ids, finished=req.is_finished,
                prompt=first.prompt, num_cached_tokens=req.num_cached_tokens,
                lora_request=group.lora_request,
                metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time,
                                       finished_time=req.finished_time),
            )  # fmt: skip
        members = group.members
        finished = not group.unforked and all(t.request.is_finished for t in members)
        kind = req.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            num_preemptions=sum(t.request.num_preemptions for t in members),
        )
        if finished:  # the whole history once, not a growing copy in every step's output
            times = [t.request.finished_time for t in members if t.request.finished_time]
            metrics.finished_time = max(times) if times else None
            metrics.token_times = list(req.token_times)
        params = req.sampling_params
        prompt_logprobs = group.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            completions = self._delta_completions(group)
            prompt_logprobs = None if group.reported else prompt_logprobs
        else:
            shown = group.members
            if params.best_of > params.n:  # vLLM V0: the n highest cumulative logprobs so far
                shown = sorted(shown, key=lambda t: t.cumulative_logprob, reverse=True)
            completions = [self._completion(i, t) for i, t in enumerate(shown[: params.n])]
        group.reported = True
        return RequestOutput(
            request_id=group.request_id,
            prompt=first.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens,
            lora_request=group.lora_request,
        )


# Incremental detokenization: a sequence's text grows by decoding only its newest tokens.
#
# Decoding the whole output again at every step costs O(length) per step, O(length^2) per request
# (on the tiny model, 64 requests of 1,000 tokens spent 44% of their time in it). Like vLLM, each
# sequence instead keeps the text up to an anchor token and decodes only the window from the
# anchor on. The anchor is the newest token whose text, and all text before it, no later token
# can change: not a byte-fallback token <0xNN> (a run of those decodes as one byte string, and one
# invalid byte turns every byte of the run into U+FFFD), and not one that ends in a multi-byte
# character still being decoded. Starting the window at the anchor, not after it, lets decoders
# that treat a string's first token differently (dropping SentencePiece's leading space) do the
# same to the window's first token as to the anchor alone, so the difference is exact.
#
# The text equals ``tokenizer.decode(ids, skip_special_tokens=...)`` after every update,
# including a trailing U+FFFD while a character is incomplete (tests/test_detokenizer.py checks
# this on byte-level and SentencePiece-style tokenizers). Should a decoder not fit this scheme
# (the window does not begin with the anchor's text), it decodes everything once and starts over.
# Where exactness cannot be guaranteed (slow Python tokenizers, whose
# ``spaces_between_special_tokens`` joins tokens differently, and tokenizers that clean up spaces
# around punctuation after decoding) it decodes everything at every step. What a tokenizer allows
# (``tokenizer_facts``) and the engine's keeper of texts (``TokenTexts``) are
# engine/token_texts.py's.
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
