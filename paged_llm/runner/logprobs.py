"""vLLM's logprobs, sampled and prompt: each scored token's log-probability and rank plus the
top-k alternatives, picked out where the logits are and packed so that one copy brings them to
the host (async scheduling makes it with the sampled ids). A step without logprobs asked for
never comes here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_llm.outputs import Logprob, LogprobEntry
from paged_llm.runner.batch import HostBatch, int_tensor, to_device
from paged_llm.sampling_params import SamplingParams


def logprob_rows(params: Sequence[SamplingParams]) -> tuple[list[int], list[int]]:
    """The rows whose sampled token's logprob is reported, and the top-k each asks for."""
    rows = [row for row, p in enumerate(params) if p.tracks_logprobs]
    return rows, [params[row].logprobs or 0 for row in rows]


def logprob_entries(
    logprobs: torch.Tensor,  # [N, V] log-probabilities
    tokens: Sequence[int],  # [N]: the token each row chose (or scores)
    top_k: int | Sequence[int],  # for every row, or one per row
) -> list[LogprobEntry]:
    """vLLM's logprobs per row: ``{token: Logprob}`` plus the ``top_k`` most likely tokens,
    each with its rank in the row (1 = most likely; the number of strictly likelier tokens
    plus one, as vLLM counts)."""
    ks = [top_k] * len(tokens) if isinstance(top_k, int) else list(top_k)
    # the token ids go over without waiting for the stream; everything comes back in one copy
    index = to_device(int_tensor(list(tokens)), logprobs.device)
    packed = pack_logprobs(logprobs, index, max(ks, default=0))
    return unpack_logprobs(packed.cpu().tolist(), list(tokens), ks)


def pack_logprobs(
    logprobs: torch.Tensor,  # [N, V] log-probabilities
    tokens: torch.Tensor,  # [N] int64 on their device: the token each row chose
    most: int,  # the largest top-k asked for
) -> torch.Tensor:  # [N * (2 + 2 * most)] float64, on the device
    """``logprob_entries``' device half: each row's chosen logprob and rank, then its ``most``
    largest logprobs and their ids, in one tensor (doubles hold float32s and ids exactly), so
    one copy brings them to the host (async scheduling makes it with the sampled ids)."""
    n = logprobs.shape[0]
    chosen = logprobs[torch.arange(n, device=logprobs.device), tokens]  # [N]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1  # [N]
    parts = [chosen.double(), ranks.double()]
    if most > 0:
        top = torch.topk(logprobs, most)  # [N, most]
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    return torch.cat(parts)


def unpack_logprobs(host: list[float], tokens: list[int], ks: list[int]) -> list[LogprobEntry]:
    """``logprob_entries``' host half: the entries from ``pack_logprobs``' values."""
    n, most = len(tokens), max(ks, default=0)
    chosen, ranks = host[:n], [int(r) for r in host[n : 2 * n]]
    entries = [{t: Logprob(lp, rank)} for t, lp, rank in zip(tokens, chosen, ranks)]
    if most > 0:
        values, ids = host[2 * n : 2 * n + n * most], host[2 * n + n * most :]
        for row, (entry, k) in enumerate(zip(entries, ks)):
            row_ids = [int(t) for t in ids[row * most : row * most + k]]
            row_values = values[row * most : row * most + k]
            entry.update(
                (t, entry[t] if t in entry else Logprob(lp, r))  # ties keep the chosen's rank
                for r, (t, lp) in enumerate(zip(row_ids, row_values), start=1)
            )
    return entries


# (index of the first prompt token scored, then per token: its logprob and the top-k's)
PromptLogprobs = tuple[int, list[LogprobEntry]]


@dataclass
class PackedPromptLogprobs:
    """A step's prompt logprobs picked out on the device (``pack_logprobs``), to be
    read on the host with ``unpack`` once copied."""

    packed: torch.Tensor  # flat float64 values (on the device, then on the host)
    targets: list[int]  # [P]: the prompt token each row scores
    ks: list[int]  # [P]: the top-k each row reports
    spans: list[tuple[str, int, int, int]]  # HostBatch.prompt_spans

    def unpack(self) -> dict[str, PromptLogprobs]:
        """The entries by request id: (first scored prompt index, one entry per token)."""
        entries = unpack_logprobs(self.packed.tolist(), self.targets, self.ks)
        out: dict[str, PromptLogprobs] = {}
        row = 0
        for request_id, first, count, _ in self.spans:
            out[request_id] = (first, entries[row : row + count])
            row += count
        return out


def pack_prompt_logprobs(
    logits: torch.Tensor,  # [P, V]: the batch's prompt-logprob rows, in batch.prompt_rows order
    batch: HostBatch,
) -> PackedPromptLogprobs | None:
    """Each scored prompt token's logprob under the model (raw logits: no penalties or
    temperature, as vLLM), plus the top ``prompt_logprobs`` alternatives, packed where the
    logits are: a copy then brings back [P, 2 + 2k] values, not [P, V] (a 2,048-token
    prompt's full rows at a 32k vocabulary would be 256 MB). None without prompt rows."""
    if not batch.prompt_rows:
        return None
    ks = [top_k for _, _, count, top_k in batch.prompt_spans for _ in range(count)]
    targets = batch.prompt_targets[: len(ks)]
    index = to_device(int_tensor(targets), logits.device)
    packed = pack_logprobs(logits.float().log_softmax(-1), index, max(ks))
    return PackedPromptLogprobs(packed, targets, ks, batch.prompt_spans)


def prompt_logprobs(logits: torch.Tensor, batch: HostBatch) -> dict[str, PromptLogprobs]:
    """``pack_prompt_logprobs``, copied to the host and read (waits for the device)."""
    pack = pack_prompt_logprobs(logits, batch)
    if pack is None:
        return {}
    pack.packed = pack.packed.cpu()
    return pack.unpack()
