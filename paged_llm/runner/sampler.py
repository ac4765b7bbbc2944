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
from paged_llm.runner.batch import int_tensor, to_device
from paged_llm.runner.logits_processors import process_request_rows
from paged_llm.runner.logprobs import logprob_entries, logprob_rows
from paged_llm.runner.top_k_top_p import sampling_probs
from paged_llm.sampling_params import SamplingParams


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
    """Samples one token per row of logits with that row's SamplingParams (draft verification
    with a drafter is spec/verify.py's)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed_rng = torch.Generator().manual_seed(seed)
        # request -> device type -> its generator: plain sampling draws on the logits'
        # device, speculative verification on the CPU
        self._generators: dict[str, dict[str, torch.Generator]] = {}

    def generator(
        self, request_id: str, params: SamplingParams, device: torch.device | str = "cpu"
    ) -> torch.Generator:
        """The request's random generator on ``device``, seeded from its params (or at random)."""
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
                gen = self.generator(requests[row].request_id, params[row], probs.device)
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
