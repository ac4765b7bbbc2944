"""The runner's token choice when a drafter is configured: each request with drafts has them
verified (rejection sampling: a prefix accepted exactly, plus one more token), the others are
sampled as without one. ``ModelRunner`` holds a ``DraftVerifier`` in place of its plain
sampling only when it is built with a drafter, so a step without speculative decoding never
enters this module."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_llm.core.request import Request
from paged_llm.core.scheduler import ScheduledRequest
from paged_llm.runner.logits_processors import process_request_rows
from paged_llm.runner.logprobs import logprob_entries
from paged_llm.runner.sampler import (
    PendingTokens,
    Sampler,
    SampleResult,
    has_constraints,
)
from paged_llm.spec.rejection import accept_greedy, verify_greedy, verify_sampled


class DraftVerifier:
    """Verifies drafts with a runner's ``Sampler`` and samples the rows without drafts."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,  # [R, V]: the batch's sample rows
        sampling: list[ScheduledRequest],
        rows_per_request: Sequence[int],  # per sampling request: 1 + its number of drafts
        draft_probs: dict[str, torch.Tensor] | None,
        pending: PendingTokens | None = None,
    ) -> dict[str, SampleResult]:
        """Sample each request's token, or verify its drafts, and bring them to the host."""
        results: dict[str, SampleResult] = {}
        plain_rows, plain, greedy_verifies = [], [], []
        row = 0
        for s, n_rows in zip(sampling, rows_per_request):
            req = s.request
            if req.spec_token_ids and verifies_plainly(req):
                greedy_verifies.append((req, row, n_rows))
            elif req.spec_token_ids:
                results[req.request_id] = self.verify(
                    logits[row : row + n_rows], req, req.spec_token_ids,
                    (draft_probs or {}).get(req.request_id),
                )  # fmt: skip
            else:
                plain_rows.append(row)
                plain.append(req)
            row += n_rows
        if greedy_verifies:
            results.update(verify_plain_greedy(logits, greedy_verifies))
        if plain:  # indexing by a host list copies it to the device: skip it when it is all
            every = len(plain_rows) == logits.shape[0]
            sampled = self.sampler(logits if every else logits[plain_rows], plain, pending)
            results.update((req.request_id, r) for req, r in zip(plain, sampled))
        return results

    def verify(
        self,
        logits: torch.Tensor,  # [k + 1, V]: after the last token and after each draft
        request: Request,
        drafts: list[int],
        draft_probs: torch.Tensor | None,  # [k, V], or None for deterministic drafts
    ) -> SampleResult:
        """Accept a prefix of the drafts exactly (rejection sampling) plus one more token."""
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
            gen = self.sampler.generator(request.request_id, params)
            tokens = verify_sampled(self.sampler.probs(logits, params), draft_probs, drafts, gen)
        lps = None
        if params.tracks_logprobs:  # row i is the distribution token i was chosen from
            rows = logits[: len(tokens)].log_softmax(-1)
            lps = logprob_entries(rows, tokens, params.logprobs or 0)
        return SampleResult(tokens[-1], lps, tokens, len(drafts), len(tokens) - 1)


def is_plain_greedy(request: Request, num_drafted: int = 0) -> bool:
    """Greedy, with no logits processing and no grammar for the token after its outputs and
    ``num_drafted`` drafts: its choice is the plain argmax of the logits (the
    drafters and the verification skip sampling for it)."""
    n = request.num_output_tokens + num_drafted
    return request.sampling_params.greedy and not has_constraints(request, n)


def verifies_plainly(request: Request) -> bool:
    """Plain greedy and without logprobs: ``verify_plain_greedy`` can take this request's
    verification."""
    return is_plain_greedy(request) and not request.sampling_params.tracks_logprobs


def verify_plain_greedy(
    logits: torch.Tensor,  # [R, V]: the batch's sample rows
    entries: list[tuple[Request, int, int]],  # (request, its first row, its k + 1 rows)
) -> dict[str, SampleResult]:
    """``DraftVerifier.verify`` for requests that ``verifies_plainly``, with one argmax and one
    device sync for all of them (on a GPU a sync per request would cost more than the step)."""
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
