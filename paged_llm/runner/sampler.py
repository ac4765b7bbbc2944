"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Each request's own logits changes (min-tokens ban, logit bias, penalties) happen first, in
``logits_processors.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_llm.core.request import Request
from paged_llm.outputs import Logprob, LogprobEntry
from paged_llm.runner.logits_processors import (
    apply_allowed_token_ids,
    needs_processing,
    process_logits,
)
from paged_llm.sampling_params import SamplingParams


@dataclass
class SampleResult:
    """The token(s) chosen for one request and, if asked, their logprobs."""

    token_id: int  # the (last) new token
    logprobs: LogprobEntry | None = None  # of token_id: it + top-k alternatives
    # speculative decoding: every token of the step, accepted drafts first (else [token_id])
    token_ids: list[int] | None = None
    num_drafts: int = 0
    num_accepted: int = 0

    def __post_init__(self) -> None:
        if self.token_ids is None:
            self.token_ids = [self.token_id]


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Mask one row of temperature-scaled logits [V] to the allowed tokens."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p; the most likely token
        # always stays (a top_p below float32's smallest number would otherwise compare as 0)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Samples one token per row of logits with that row's SamplingParams."""

    def __init__(self, seed: int = 0) -> None:
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(2**62, (1,), generator=self._seed_rng))
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def forget(self, request_id: str) -> None:
        """Drop a finished request's random state."""
        self._generators.pop(request_id, None)

    def probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distribution sampling draws from for rows of logits [R, V] (CPU, float32)."""
        p = params
        rows = [
            apply_top_k_top_p_min_p(r / p.temperature, p.top_k, p.top_p, p.min_p)
            for r in logits.float().cpu()
        ]
        return torch.stack(rows).softmax(-1)

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
        if request.guide is not None or needs_processing(params, request.num_output_tokens):
            # row i scores the token after drafts[:i], so its history includes them
            out = request.output_token_ids
            histories = [out + drafts[:i] for i in range(len(drafts) + 1)]
            process_request_rows(logits, request, histories)
        if params.greedy:
            tokens = verify_greedy(logits, drafts)
        else:
            gen = self._generator(request.request_id, params)
            tokens = verify_sampled(self.probs(logits, params), draft_probs, drafts, gen)
        lp = None
        if params.tracks_logprobs:
            row = logits[len(tokens) - 1].log_softmax(-1)
            lp = self._logprobs(row[None], 0, tokens[-1], params)
        return SampleResult(tokens[-1], lp, tokens, len(drafts), len(tokens) - 1)

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V]: row i is the next-token logits of requests[i]
        requests: Sequence[Request],
    ) -> list[SampleResult]:
        """Choose one token per row."""
        logits = logits.float()
        for row, req in enumerate(requests):  # a no-op for requests without constraints
            process_request_rows(logits[row : row + 1], req, [req.output_token_ids])
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.tracks_logprobs for p in params)
        logprobs = logits.log_softmax(-1) if want_logprobs else None
        tokens = logits.argmax(-1).tolist()  # the greedy rows' tokens; the others are drawn
        cpu_logits = None
        for row, (req, p) in enumerate(zip(requests, params)):
            if not p.greedy:
                if cpu_logits is None:
                    cpu_logits = logits.cpu()  # torch.Generator here lives on the CPU
                scaled = apply_top_k_top_p_min_p(
                    cpu_logits[row] / p.temperature, p.top_k, p.top_p, p.min_p
                )
                probs = scaled.softmax(-1)
                gen = self._generator(req.request_id, p)
                tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
        entries: list[LogprobEntry | None] = [None] * len(requests)
        if logprobs is not None:  # one batched call for every row that reports logprobs
            rows = [row for row, p in enumerate(params) if p.tracks_logprobs]
            chosen = [tokens[row] for row in rows]
            top_k = [params[row].logprobs or 0 for row in rows]
            for row, entry in zip(rows, logprob_entries(logprobs[rows], chosen, top_k)):
                entries[row] = entry
        return [SampleResult(token, entry) for token, entry in zip(tokens, entries)]

    @staticmethod
    def _logprobs(
        logprobs: torch.Tensor | None, row: int, token: int, p: SamplingParams
    ) -> LogprobEntry | None:
        if logprobs is None or not p.tracks_logprobs:
            return None
        return logprob_entries(logprobs[row : row + 1], [token], p.logprobs or 0)[0]


def logprob_entries(
    logprobs: torch.Tensor,  # [N, V] log-probabilities
    tokens: Sequence[int],  # [N]: the token each row chose (or scores)
    top_k: int | Sequence[int],  # for every row, or one per row
) -> list[LogprobEntry]:
    """vLLM's logprobs per row: ``{token: Logprob}`` plus the ``top_k`` most likely tokens,
    each with its rank in the row (1 = most likely; the number of strictly likelier tokens
    plus one, as vLLM counts)."""
    ks = [top_k] * len(tokens) if isinstance(top_k, int) else list(top_k)
    index = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)
    chosen_t = logprobs[torch.arange(len(index), device=logprobs.device), index]  # [N]
    ranks = ((logprobs > chosen_t[:, None]).sum(-1) + 1).tolist()
    entries = [{t: Logprob(lp, rank)} for t, lp, rank in zip(tokens, chosen_t.tolist(), ranks)]
    most = max(ks, default=0)
    if most > 0:
        top = torch.topk(logprobs, most)
        for entry, k, ids, values in zip(entries, ks, top.indices.tolist(), top.values.tolist()):
            entry.update(
                (t, entry[t] if t in entry else Logprob(lp, r))  # ties keep the chosen's rank
                for r, (t, lp) in enumerate(zip(ids[:k], values[:k]), start=1)
            )
    return entries


def process_request_rows(
    logits: torch.Tensor,  # [R, V] float32 rows of one request, changed in place
    request: Request,
    outputs: Sequence[Sequence[int]],  # per row: the output tokens before it
) -> torch.Tensor:
    """``logits_processors.process_logits`` for a request's rows (skipped when it is a no-op),
    then its grammar's mask (structured output).

    Every row keeps at least one token, so one request's conflicting constraints can never
    fail the batch it runs in. The whitelists win over the bans: a row the bans leave without
    any token (say ``allowed_token_ids=[eos]`` before ``min_tokens``) keeps the whitelists
    alone. If the two whitelists exclude each other mid-output (the engine refuses requests
    whose grammar accepts none of ``allowed_token_ids`` first), the grammar alone wins, so the
    output stays well-formed."""
    params = request.sampling_params
    processed = needs_processing(params, min(len(o) for o in outputs))
    if request.guide is None and not processed:
        return logits
    raw = logits.clone()  # the grammar-only fallback, and the base of the whitelists' one
    if processed:
        _process(logits, request, outputs)
    if request.guide is not None:
        accepted = request.num_output_tokens  # what the guide has seen; the rest is drafts
        allowed = torch.stack([request.guide.allowed(o[accepted:]) for o in outputs])  # [R, V]
        disallowed = ~allowed.to(logits.device)
        logits.masked_fill_(disallowed, float("-inf"))
        raw.masked_fill_(disallowed, float("-inf"))
    empty = ~torch.isfinite(logits).any(-1, keepdim=True)  # [R, 1]
    if bool(empty.any()):  # rare: build the weaker constraints only now
        whitelists = apply_allowed_token_ids(raw.clone(), params)
        for fallback in (whitelists, raw):  # the next-weaker constraint for rows left empty
            logits.copy_(torch.where(empty, fallback, logits))
            empty = ~torch.isfinite(logits).any(-1, keepdim=True)
            if not bool(empty.any()):
                break
    return logits


def _process(
    logits: torch.Tensor, request: Request, outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    params = request.sampling_params
    return process_logits(
        logits, params, request.prompt_token_ids, outputs, request.eos_token_id,
        request.bad_words_token_ids,
    )  # fmt: skip
