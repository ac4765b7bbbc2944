"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Each request's own logits changes (min-tokens ban, logit bias, penalties) happen first, in
``logits_processors.py``; a sampled row's distribution (temperature, top-k / top-p / min-p) is
``top_k_top_p.py``'s, and the logprobs reported are ``logprobs.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from paged_llm.core.request import PLACEHOLDER_TOKEN, Request
from paged_llm.outputs import LogprobEntry
from paged_llm.runner.logits_processors import (
    apply_allowed_token_ids,
    process_logits,
)
from paged_llm.runner.logprobs import logprob_entries, logprob_rows
from paged_llm.runner.top_k_top_p import sampling_probs
from paged_llm.sampling_params import SamplingParams
from paged_llm.utils.host import int_tensor, to_device


@dataclass
class SampleResult:
    """The token(s) chosen for one request and, if asked, their logprobs."""

    token_id: int  # the (last) new token
    # if asked: per token of token_ids, its logprob + the top-k alternatives at its position
    logprobs: list[LogprobEntry] | None = None
    # speculative decoding: every token of the step, accepted drafts first (else [token_id])
    token_ids: list[int] | None = None
    num_drafts: int = 0
    num_accepted: int = 0

    def __post_init__(self) -> None:
        if self.token_ids is None:
            self.token_ids = [self.token_id]


# request id -> its last output token, still on the device ([1] int64; async scheduling)
PendingTokens = Callable[[str], torch.Tensor]


class Sampler:
    """Samples one token per row of logits with that row's SamplingParams."""

    def __init__(self, seed: int = 0) -> None:
        self._seed_rng = torch.Generator().manual_seed(seed)
        # request -> device type -> its generator: plain sampling draws on the logits'
        # device, speculative verification on the CPU
        self._generators: dict[str, dict[str, torch.Generator]] = {}

    def _generator(
        self, request_id: str, params: SamplingParams, device: torch.device | str = "cpu"
    ) -> torch.Generator:
        own = self._generators.setdefault(request_id, {})
        device_type = torch.device(device).type
        gen = own.get(device_type)
        if gen is None:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(2**62, (1,), generator=self._seed_rng))
            gen = own[device_type] = torch.Generator(device=device).manual_seed(seed)
        return gen

    def forget(self, request_id: str) -> None:
        """Drop a finished request's random state."""
        self._generators.pop(request_id, None)

    def probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distribution sampling draws from for rows of logits [R, V] (CPU, float32)."""
        return sampling_probs(logits.float().cpu(), [params] * logits.shape[0])

    def verify(
        self,
        logits: torch.Tensor,  # [k + 1, V]: after the last token and after each draft
        request: Request,
        drafts: list[int],
        draft_probs: torch.Tensor | None,  # [k, V], or None for deterministic drafts
    ) -> SampleResult:
        """Accept a prefix of the drafts exactly (rejection sampling) plus one more token."""
        from paged_llm.spec.rejection import verify_greedy, verify_sampled

        params = request.sampling_params
        logits = logits.float()
        if has_constraints(request, request.num_output_tokens):
            # row i scores the token after drafts[:i], so its history includes them
            out = request.output_token_ids
            histories = [out + drafts[:i] for i in range(len(drafts) + 1)]
            process_request_rows(logits, request, histories)
        if params.greedy:
            tokens = verify_greedy(logits, drafts)
        else:
            gen = self._generator(request.request_id, params)
            tokens = verify_sampled(self.probs(logits, params), draft_probs, drafts, gen)
        lps = None
        if params.tracks_logprobs:  # row i is the distribution token i was chosen from
            rows = logits[: len(tokens)].log_softmax(-1)
            lps = logprob_entries(rows, tokens, params.logprobs or 0)
        return SampleResult(tokens[-1], lps, tokens, len(drafts), len(tokens) - 1)

    @staticmethod
    def verifies_plainly(request: Request) -> bool:
        """Plain greedy and without logprobs: ``verify_plain_greedy`` can take this request's
        verification."""
        return is_plain_greedy(request) and not request.sampling_params.tracks_logprobs

    def verify_plain_greedy(
        self,
        logits: torch.Tensor,  # [R, V]: the batch's sample rows
        entries: list[tuple[Request, int, int]],  # (request, its first row, its k + 1 rows)
    ) -> dict[str, SampleResult]:
        """``verify`` for requests that ``verifies_plainly``, with one argmax and one device
        sync for all of them (on a GPU a sync per request would cost more than the step)."""
        from paged_llm.spec.rejection import accept_greedy

        rows = [r for _, first, n in entries for r in range(first, first + n)]
        best = logits[rows].argmax(-1).tolist()
        results, i = {}, 0
        for req, _, n in entries:
            drafts = req.spec_token_ids
            tokens = accept_greedy(best[i : i + n], drafts)
            i += n
            results[req.request_id] = SampleResult(
                tokens[-1], None, tokens, len(drafts), len(tokens) - 1
            )
        return results

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V]: row i is the next-token logits of requests[i]
        requests: Sequence[Request],
        pending: PendingTokens | None = None,
    ) -> list[SampleResult]:
        """Choose one token per row (``pending``: see ``sample_ids``)."""
        logits = logits.float()
        picked = self.sample_ids(logits, requests, pending=pending)
        tokens = picked.tolist()  # the step's one wait for the device
        params = [r.sampling_params for r in requests]
        if not any(p.tracks_logprobs for p in params):
            return [SampleResult(token) for token in tokens]
        logprobs = logits.log_softmax(-1)
        entries: list[LogprobEntry | None] = [None] * len(requests)
        rows, top_k = logprob_rows(params)  # one batched call for them all
        chosen = [tokens[row] for row in rows]
        for row, entry in zip(rows, logprob_entries(logprobs[rows], chosen, top_k)):
            entries[row] = entry
        return [
            SampleResult(token, None if entry is None else [entry])
            for token, entry in zip(tokens, entries)
        ]

    def sample_ids(
        self,
        logits: torch.Tensor,  # [N, V] float32: row i is the next-token logits of requests[i]
        requests: Sequence[Request],
        may_wait: bool = True,
        pending: PendingTokens | None = None,
    ) -> torch.Tensor:  # [N] int64, on the logits' device
        """The chosen token of every row, left on the device (processing ``logits`` in place).
        Without ``may_wait`` nothing waits for the device (``mask_rows``,
        ``process_request_rows``). Under async scheduling an output may end in a placeholder;
        ``pending(request_id)`` is its token, still on the device (the penalties count it)."""
        for row, req in enumerate(requests):  # most requests have no constraints: no row view
            if has_constraints(req, req.num_output_tokens):
                out = req.output_token_ids
                token = None
                if pending is not None and out and out[-1] == PLACEHOLDER_TOKEN:
                    token = pending(req.request_id)
                process_request_rows(logits[row : row + 1], req, [out], may_wait, token)
        params = [r.sampling_params for r in requests]
        picked = logits.argmax(-1)  # [N]: the greedy rows' tokens; the others are drawn
        drawn = [row for row, p in enumerate(params) if not p.greedy]
        if drawn:  # on the logits' device (no [N, V] copy to the host); a generator per request
            # rows picked by a device index (a host list would be copied from pageable memory,
            # which waits for the device), or none when every row is drawn
            every = len(drawn) == len(requests)
            index = None if every else to_device(int_tensor(drawn), logits.device)
            probs = sampling_probs(logits if index is None else logits[index],
                                   [params[row] for row in drawn], may_wait)  # fmt: skip
            # argmax of p / E with E ~ Exp(1) draws token i with probability p_i (as vLLM
            # samples); one fill per row from its generator, one argmax for the batch
            noise = torch.empty_like(probs)
            for i, row in enumerate(drawn):
                gen = self._generator(requests[row].request_id, params[row], probs.device)
                noise[i].exponential_(generator=gen)
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a 0 would make a banned 0 / 0 NaN
            chosen = (probs / noise).argmax(-1)
            picked = chosen if index is None else picked.index_put((index,), chosen)
        return picked


def has_constraints(request: Request, num_output_tokens: int) -> bool:
    """Whether a row after ``num_output_tokens`` tokens needs ``process_request_rows``: logits
    processing or a grammar (most requests have neither)."""
    params = request.sampling_params
    return request.guide is not None or params.needs_logits_processing(num_output_tokens)


def is_plain_greedy(request: Request, num_drafted: int = 0) -> bool:
    """Greedy, with no logits processing and no grammar for the token after its outputs and
    ``num_drafted`` drafts: its choice is the plain argmax of the logits."""
    n = request.num_output_tokens + num_drafted
    return request.sampling_params.greedy and not has_constraints(request, n)


def process_request_rows(
    logits: torch.Tensor,  # [R, V] float32 rows of one request, changed in place
    request: Request,
    outputs: Sequence[Sequence[int]],  # per row: the output tokens before it
    may_wait: bool = True,  # False: never read a device value (see below)
    pending: torch.Tensor | None = None,  # [1] on the device: a placeholder's token (penalties)
) -> torch.Tensor:
    """``logits_processors.process_logits`` for a request's rows (skipped when it is a no-op),
    then its grammar's mask (structured output).

    Every row keeps at least one token, so one request's conflicting constraints can never
    fail the batch it runs in. The whitelists win over the bans: a row the bans leave without
    any token (say ``allowed_token_ids=[eos]`` before ``min_tokens``) keeps the whitelists
    alone. If the two whitelists exclude each other mid-output (the engine refuses requests
    whose grammar accepts none of ``allowed_token_ids`` first), the grammar alone wins, so the
    output stays well-formed. Whether a row was left empty is a device value: without
    ``may_wait`` the weaker constraints are applied by ``torch.where`` without asking."""
    params = request.sampling_params
    processed = params.needs_logits_processing(min(len(o) for o in outputs))
    if request.guide is None and not processed:
        return logits
    raw = logits.clone()  # the grammar-only fallback, and the base of the whitelists' one
    if processed:
        _process(logits, request, outputs, pending)
    if request.guide is not None:
        accepted = request.num_output_tokens  # what the guide has seen; the rest is drafts
        allowed = torch.stack([request.guide.allowed(o[accepted:]) for o in outputs])  # [R, V]
        disallowed = ~allowed.to(logits.device)
        logits.masked_fill_(disallowed, float("-inf"))
        raw.masked_fill_(disallowed, float("-inf"))
    empty = ~torch.isfinite(logits).any(-1, keepdim=True)  # [R, 1]
    if not may_wait or bool(empty.any()):  # rare: build the weaker constraints only now
        whitelists = apply_allowed_token_ids(raw.clone(), params)
        for fallback in (whitelists, raw):  # the next-weaker constraint for rows left empty
            logits.copy_(torch.where(empty, fallback, logits))
            empty = ~torch.isfinite(logits).any(-1, keepdim=True)
            if may_wait and not bool(empty.any()):
                break
    return logits


def _process(
    logits: torch.Tensor,
    request: Request,
    outputs: Sequence[Sequence[int]],
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    params = request.sampling_params
    return process_logits(
        logits, params, request.prompt_token_ids, outputs, request.eos_token_id,
        request.bad_words_token_ids, pending,
    )  # fmt: skip
