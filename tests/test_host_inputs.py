"""Host-side step inputs built without per-element Python loops: a request's query tokens
sliced without joining its lists, block tables kept as int64 rows between steps and padded
by memcpy."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.attention.metadata import padded_block_tables
from paged_llm.core.kv.base import NULL_BLOCK
from paged_llm.core.request import Request
from paged_llm.core.scheduler import ScheduledRequest
from paged_llm.runner.batch import BlockTableRows, flatten_batch, padded_int_rows
from paged_llm.sampling_params import SamplingParams

tokens = st.lists(st.integers(0, 1000), max_size=12)


@settings(max_examples=200, deadline=None)
@given(prompt=tokens.filter(bool), output=tokens, drafts=tokens, data=st.data())
def test_token_ids_between_equals_slicing_the_joined_lists(prompt, output, drafts, data):
    req = Request("r", prompt, SamplingParams(), max_model_len=64,
                  output_token_ids=list(output), spec_token_ids=list(drafts))  # fmt: skip
    joined = prompt + output + drafts
    start = data.draw(st.integers(0, len(joined)))
    end = data.draw(st.integers(start, len(joined) + 2))
    assert req.token_ids_between(start, end) == joined[start:end]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 2**40), max_size=9), max_size=7),
       width=st.integers(0, 12))  # fmt: skip
def test_padded_int_rows_pads_each_row_with_zeros(rows, width):
    out = padded_int_rows(rows, width)
    w = max([width, *map(len, rows)])
    assert out.dtype == torch.int64 and tuple(out.shape) == (len(rows), w)
    assert out.tolist() == [r + [0] * (w - len(r)) for r in rows]


def test_padded_block_tables_read_window_freed_blocks_as_block_zero():
    """A sliding window frees a table's prefix (NULL_BLOCK): the kernels get block 0 there."""
    tables = [[NULL_BLOCK, NULL_BLOCK, 7, 8], [3]]
    assert padded_block_tables(tables).tolist() == [[0, 0, 7, 8], [3, 0, 0, 0]]
    assert padded_block_tables([], 3).shape == (0, 3)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.dictionaries(st.sampled_from("abcd"),
                                      st.lists(st.integers(-1, 50), max_size=6)),
                      min_size=1, max_size=8))  # fmt: skip
def test_block_table_rows_follow_every_table_change(steps):
    """Each step's tables (appended, rewritten in the middle, shrunk, gone) come back as
    equal rows; a table unchanged since the last step reuses its row, and a row handed out
    never changes afterwards."""
    rows, handed = BlockTableRows(), []
    previous: dict[str, tuple[list[int], object]] = {}
    for tables in steps:
        for rid, table in tables.items():
            row = rows.row(rid, table)
            assert list(row) == table
            if rid in previous and previous[rid][0] == table:
                assert row is previous[rid][1]
            previous[rid] = (list(table), row)
            handed.append((row, list(table)))
        for gone in set(previous) - set(tables):
            rows.forget(gone)
            del previous[gone]
        assert len(rows) == len(previous)
    assert all(list(row) == table for row, table in handed)


def test_flatten_batch_bounds_the_rows_it_keeps():
    """Rows of requests the runner was never told are gone are dropped once they outnumber
    the step's requests (2 x + 64)."""
    rows = BlockTableRows()
    for i in range(70):
        rows.row(f"old{i}", [i])
    req = Request("now", [1, 2, 3], SamplingParams(), max_model_len=64)
    batch, _ = flatten_batch([ScheduledRequest(req, 3, [5])], rows)
    assert len(rows) == 1 and list(batch.block_tables[0]) == [5]


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 6), st.integers(0, 3),
                                st.integers(0, 4), st.sampled_from([None, 2])),
                      min_size=1, max_size=6))  # fmt: skip
def test_flatten_batch_decode_fast_path_builds_the_general_batch(specs):
    """Plain decodes take a shortcut in flatten_batch; with the shortcut off, every batch (plain
    decodes beside prompt chunks, drafts and prompt logprobs) comes out the same."""
    import paged_llm.runner.batch as batch_module

    scheduled = []
    for i, (prompt, outputs, drafts, behind, prompt_logprobs) in enumerate(specs):
        req = Request(f"r{i}", list(range(10, 10 + prompt)),
                      SamplingParams(prompt_logprobs=prompt_logprobs), max_model_len=64,
                      output_token_ids=list(range(50, 50 + outputs)),
                      spec_token_ids=list(range(90, 90 + drafts)))  # fmt: skip
        total = req.num_tokens + drafts
        req.num_computed_tokens = max(0, req.num_tokens - 1 - behind)
        n = total - req.num_computed_tokens
        scheduled.append(ScheduledRequest(req, n, list(range(total // 4 + 1))))
    fast, fast_sampling = flatten_batch(scheduled)
    original = batch_module.plain_decode
    batch_module.plain_decode = lambda *a: False
    try:
        general, general_sampling = flatten_batch(scheduled)
    finally:
        batch_module.plain_decode = original
    assert fast == general and fast_sampling == general_sampling
