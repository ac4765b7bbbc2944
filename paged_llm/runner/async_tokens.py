"""Async scheduling's device side: a step's sampled ids stay on the device, feed the next
step's placeholder tokens there, and reach the host through a copy that does not wait for
that next step (docs/architecture.md, "Async scheduling").

The scheduler plans step N + 1 with a placeholder (core.request.PLACEHOLDER_TOKEN) for each
token step N sampled. The runner builds N + 1's inputs as usual and then writes step N's
sampled ids over the placeholders, on the device (``feed_placeholders``); step N's ids are
read on the host once N + 1 is launched (``DeferredTokens.collect``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from paged_llm.core.request import Request
from paged_llm.outputs import LogprobEntry
from paged_llm.runner.batch import int_tensor, to_device
from paged_llm.runner.logprobs import (
    PackedPromptLogprobs,
    PromptLogprobs,
    logprob_rows,
    pack_logprobs,
    pack_prompt_logprobs,
    unpack_logprobs,
)
from paged_llm.runner.sampler import PendingTokens, Sampler, SampleResult


def can_defer(requests: Sequence[Request]) -> bool:
    """Whether these sampling requests' tokens may reach the host a step late: none needs its
    output tokens on the host to sample (user logits processors, called with lists; a
    grammar) or verifies drafts. The rest of logits processing needs only the count of
    outputs, placeholders included (min_tokens, logit_bias, allowed_token_ids), or reads a
    placeholder's token on the device (penalties, bad words; ``token_of``). A request that
    needs its outputs on the host does so for its whole life, so it is never in a deferred
    step and its history never holds a placeholder."""
    return not any(
        r.spec_token_ids or r.guide is not None or r.sampling_params.logits_processors
        for r in requests
    )


@dataclass
class DeferredTokens:
    """One step's sampled ids (and the logprobs asked for) on their way to the host:
    ``requests[i]`` chose ``ids[i]``."""

    requests: list[Request]
    ids: torch.Tensor  # [N] int64 on the device: what the next step's placeholders read
    rows: dict[str, int]  # request id -> its row of ids
    host: torch.Tensor  # [N] int64 on the host (pinned on a GPU), filled by a non-blocking copy
    copied: torch.cuda.Event | None  # recorded after the copies (None on the CPU)
    # the rows that report logprobs, the top-k of each, and logprobs.pack_logprobs' values of
    # those rows on the host (copied with the ids)
    logprob_rows: list[int] = field(default_factory=list)
    logprob_ks: list[int] = field(default_factory=list)
    logprobs_host: torch.Tensor | None = None
    prompt: PackedPromptLogprobs | None = None  # the step's prompt logprobs, copied with them

    @classmethod
    def start(
        cls,
        requests: list[Request],
        ids: torch.Tensor,
        logits: torch.Tensor,
        prompt: PackedPromptLogprobs | None = None,
    ) -> DeferredTokens:
        """Pack the logprobs asked for from ``logits`` [N, V] (float32, as sampled) and start
        the copies to the host, the step's packed prompt logprobs with them; they are queued
        before the next step's work."""
        rows = {r.request_id: i for i, r in enumerate(requests)}
        lp_rows, ks = logprob_rows([r.sampling_params for r in requests])
        packed = None
        if lp_rows:  # the sampled ids index the rows on the device: nothing from the host
            index = to_device(int_tensor(lp_rows), ids.device)
            packed = pack_logprobs(logits[index].log_softmax(-1), ids[index], max(ks))
        if ids.device.type != "cuda":
            return cls(requests, ids, rows, ids, None, lp_rows, ks, packed, prompt)
        host = ids.to("cpu", non_blocking=True)  # pinned: the copy does not block the host
        packed = packed.to("cpu", non_blocking=True) if packed is not None else None
        if prompt is not None:
            prompt.packed = prompt.packed.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(requests, ids, rows, host, copied, lp_rows, ks, packed, prompt)

    def token_of(self, request_id: str) -> torch.Tensor:  # [1] int64 on the device
        """The id one request sampled, still on the device (``sampler.PendingTokens``)."""
        row = self.rows[request_id]
        return self.ids[row : row + 1]

    def prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        """The step's prompt logprobs by request id (read after ``collect`` waited)."""
        return self.prompt.unpack() if self.prompt is not None else {}

    def collect(self) -> tuple[list[tuple[Request, int]], dict[str, SampleResult]]:
        """Each request with its token, and the step's results by request id, once the copy
        is done (it waits for the step that sampled them, not for the steps after it)."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens = self.host.tolist()
        entries: dict[int, LogprobEntry] = {}
        if self.logprobs_host is not None:
            chosen = [tokens[row] for row in self.logprob_rows]
            unpacked = unpack_logprobs(self.logprobs_host.tolist(), chosen, self.logprob_ks)
            entries = dict(zip(self.logprob_rows, unpacked))
        results = {
            r.request_id: SampleResult(t, [entries[i]] if i in entries else None)
            for i, (r, t) in enumerate(zip(self.requests, tokens))
        }
        return list(zip(self.requests, tokens)), results


def feed_placeholders(
    input_ids: torch.Tensor,  # [T'] the step's input ids on the device, its tokens first
    placeholders: Sequence[tuple[int, str]],  # (token index, request id) of each placeholder
    last: DeferredTokens | None,  # the step before's sampled ids
) -> None:
    """Write each placeholder's sampled id (from the step before, still on the device) into
    the step's input ids."""
    if not placeholders:
        return
    if last is None:
        raise RuntimeError("a placeholder token was scheduled without the step that sampled it")
    rows = [last.rows[rid] for _, rid in placeholders]
    where = to_device(int_tensor([i for i, _ in placeholders] + rows), input_ids.device)
    dst, src = where.split(len(placeholders))
    input_ids[dst] = last.ids[src].to(input_ids.dtype)


def sample_deferred(
    sampler: Sampler,
    logits: torch.Tensor,  # [R, V]: the step's sample rows, one per request
    requests: list[Request],
    prompt_rows: torch.Tensor,  # [P, V]: its prompt-logprob rows
    batch: Any,  # runner.batch.HostBatch
    pending: PendingTokens | None,
) -> DeferredTokens:
    """Sample the step's tokens and leave them on the device (async scheduling, requests that
    ``can_defer``): the ids and the logprobs asked for start their copy to the host."""
    logits = logits.float()
    # a CPU computes as the host asks, so waiting on it costs nothing (and its top-p path that
    # may wait is the faster one)
    ids = sampler.sample_ids(logits, requests, logits.device.type == "cpu", pending)
    prompt = pack_prompt_logprobs(prompt_rows, batch)  # copied with the ids
    return DeferredTokens.start(requests, ids, logits, prompt)
