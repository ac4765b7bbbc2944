"""One step's batch as the runner builds it: the scheduled requests flattened into host lists
(decodes first, for the attention backends), then the device tensors a forward reads (its
prompt logprobs are read back by logprobs.py). The int helpers at the top turn host lists
into tensors fast; every runner file and the attention metadata use them."""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from paged_llm.core.request import PLACEHOLDER_TOKEN, Request
from paged_llm.core.scheduler import ScheduledRequest

if TYPE_CHECKING:  # attention/metadata.py builds its tensors with this module's int helpers
    from paged_llm.attention.metadata import AttentionMetadata


def int_tensor(values: Sequence[int]) -> torch.Tensor:  # [len(values)] int64, on the CPU
    """A CPU int64 tensor of a flat list of ints, through ``array.array``: about 4x faster than
    ``torch.tensor`` (a batch-256 decode step's 16,000 input ints: 0.22 against 0.83 ms on the
    project's CPU machine; experiments/bench_step_inputs.py, docs/results/step_inputs-*.json),
    which matters once a GPU step takes milliseconds."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on ``device``, without the host waiting for the device's queue: on a
    GPU through pinned memory and a non-blocking copy (a copy from pageable memory waits for
    the stream, which under async scheduling is the previous step's whole forward; PyTorch's
    pinned-memory cache keeps the source until the copy ran). The tensor itself on the CPU."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def padded_int_rows(rows: Sequence[Sequence[int]], width: int = 0) -> torch.Tensor:
    """Ragged rows of ints as one zero-padded CPU int64 tensor [len(rows), W], W the widest row
    or ``width`` if wider. Rows given as ``array.array("q")`` (``BlockTableRows``)
    are copied by memcpy, not int by int: a step's block tables are 256 sequences x ~60
    blocks, every step."""
    w = max([width, *(len(r) for r in rows)])
    zeros = array.array("q", bytes(8 * w))
    flat = array.array("q")
    for r in rows:
        flat.extend(r)
        flat.extend(zeros[: w - len(r)])
    if not flat:
        return torch.zeros(len(rows), w, dtype=torch.int64)
    return torch.frombuffer(flat, dtype=torch.int64).view(len(rows), w)


@dataclass
class HostBatch:
    """One step's flat batch as host lists (decodes first): all any rank needs to run it."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B] context length including this step's tokens
    block_tables: list[Sequence[int]]  # [B] physical block ids (lists, or BlockTableRows' rows)
    sample_rows: list[int]  # [R] rows of T whose logits are needed
    rows_per_request: list[int]  # per sampling request: 1, or 1 + number of draft tokens
    # prompt_logprobs: rows of T whose logits score the next prompt token ([P], computed after
    # the R sample rows), the token each scores ([P]), and per request (request id, index of
    # its first prompt token scored, count, top-k alternatives wanted)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[str, int, int, int]] = field(default_factory=list)
    lora_ids: list[int] = field(default_factory=list)  # [B] each request's adapter (0 = none)
    # pooling requests: per prompt chunk (request id, first row of T, first prompt position,
    # rows, prompt length); their rows' hidden states go to the pooler, not to the LM head
    pool_spans: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    # async scheduling: (index in input_ids, request id) of each token still on the device
    # (core.request.PLACEHOLDER_TOKEN); the runner writes the sampled ids over them
    placeholders: list[tuple[int, str]] = field(default_factory=list)


def is_decode_batch(batch: Any) -> bool:
    """True when every sequence of the HostBatch feeds exactly one token (a pure decode)."""
    return bool(batch.query_lens) and all(q == 1 for q in batch.query_lens)


@dataclass
class StepInputs:
    """The device inputs of one step's forward (decodes first)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata


class BlockTableRows:
    """The scheduled requests' block tables as ``array.array("q")`` rows, kept from step to
    step: a table unchanged since the last step (a decode's, 15 steps in 16) is recognised by
    a list comparison and not converted again, and the padded table tensor is then built by
    memcpy (``padded_int_rows``). A changed table gets a new row, so a batch's rows
    never change after it is built."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[list[int], array.array]] = {}  # id -> (table copy, row)

    def row(self, request_id: str, table: list[int]) -> array.array:
        """The request's table as a row of int64s."""
        kept = self._rows.get(request_id)
        if kept is None or kept[0] != table:
            kept = self._rows[request_id] = (list(table), array.array("q", table))
        return kept[1]

    def keep_only(self, request_ids: set[str]) -> None:
        """Drop every row but these (the runner's bound on rows of requests it was never told
        are gone)."""
        self._rows = {rid: kept for rid, kept in self._rows.items() if rid in request_ids}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's row."""
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)


def order_for_backend(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Shortest queries first (stable): decodes lead, as AttentionMetadata requires, and short
    multi-token queries (speculative verifications) follow them, where the CPU backend's kernel
    rows take the leading run, instead of behind a long prompt chunk."""
    return sorted(scheduled, key=lambda s: s.num_new_tokens)


def plain_decode(req: Request, start: int, end: int) -> bool:
    """Whether computing tokens ``start`` to ``end`` of ``req`` is a plain decode: its last
    output token alone, no drafts, so it samples the next token and scores no prompt token."""
    return (end == start + 1 == req.num_tokens and start >= req.num_prompt_tokens
            and not req.spec_token_ids and req.pooling_params is None)  # fmt: skip


def flatten_batch(
    scheduled: list[ScheduledRequest], table_rows: BlockTableRows | None = None
) -> tuple[HostBatch, list[ScheduledRequest]]:
    """The scheduled requests' flat host batch, and the requests that sample, in row order;
    ``table_rows`` (kept by the caller between steps) turns the block tables into rows."""
    ordered = order_for_backend(scheduled)
    if table_rows is not None and len(table_rows) > 2 * len(scheduled) + 64:
        table_rows.keep_only({s.request.request_id for s in scheduled})
    ids: list[int] = []
    positions: list[int] = []
    query_lens, seq_lens, tables, rows, sampling, per_req = [], [], [], [], [], []
    lora_ids: list[int] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_spans: list[tuple[str, int, int, int]] = []
    pool_spans: list[tuple[str, int, int, int, int]] = []
    placeholders: list[tuple[int, str]] = []
    for s in ordered:
        req, start = s.request, s.request.num_computed_tokens
        end = start + s.num_new_tokens
        tables.append(
            s.block_table if table_rows is None else table_rows.row(req.request_id, s.block_table)
        )
        lora_ids.append(req.lora_int_id)
        query_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        if plain_decode(req, start, end):  # most of a step's requests: one row that samples
            rows.append(len(ids))
            token = req.output_token_ids[-1]
            if token == PLACEHOLDER_TOKEN:
                placeholders.append((len(ids), req.request_id))
            ids.append(token)
            positions.append(start)
            sampling.append(s)
            per_req.append(1)
            continue
        ids += req.token_ids_between(start, end)
        if ids[-1] == PLACEHOLDER_TOKEN:  # only a sequence's last token can be one
            placeholders.append((len(ids) - 1, req.request_id))
        positions.extend(range(start, end))
        if req.is_pooling:
            first_row = len(ids) - s.num_new_tokens
            pool_spans.append((req.request_id, first_row, start, s.num_new_tokens,
                               req.num_prompt_tokens))  # fmt: skip
            continue
        if s.samples:
            n_rows = 1 + len(req.spec_token_ids)  # verify each draft, plus one more token
            rows.extend(range(len(ids) - n_rows, len(ids)))
            sampling.append(s)
            per_req.append(n_rows)
        # the row at position p scores prompt token p + 1; the last prompt position's row
        # scores the first output token (a sample row), so it is not one of these
        scored_end = min(end, req.num_prompt_tokens - 1)
        top_k = req.sampling_params.prompt_logprobs
        if top_k is not None and start < scored_end:
            first_row = len(ids) - (end - start)
            prompt_rows.extend(range(first_row, first_row + scored_end - start))
            prompt_targets.extend(req.prompt_token_ids[start + 1 : scored_end + 1])
            prompt_spans.append((req.request_id, start + 1, scored_end - start, top_k))
    batch = HostBatch(ids, positions, query_lens, seq_lens, tables, rows, per_req,
                      prompt_rows, prompt_targets, prompt_spans, lora_ids, pool_spans,
                      placeholders)  # fmt: skip
    return batch, sampling


def to_step_inputs(
    batch: HostBatch,
    block_size: int,
    device: torch.device,
    backend: Any,  # attention.base.AttentionBackend: it builds the metadata it reads
) -> StepInputs:
    """Device tensors and attention metadata of a host batch."""
    meta = backend.build_metadata(
        batch.query_lens, batch.seq_lens, batch.block_tables, block_size, device
    )
    input_ids, positions = to_device(int_tensor(batch.input_ids + batch.positions), device).chunk(2)
    return StepInputs(input_ids=input_ids, positions=positions, attn_metadata=meta)
