"""Attention metadata for sequences in any order, as drafters batch them: the runner orders its
own batch (decodes first, as ``AttentionMetadata`` requires), a drafter's rows come in its
own order and are permuted in and back out."""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_llm.attention.metadata import AttentionMetadata, build_attention_metadata


def build_metadata_any_order(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    build: Callable[..., AttentionMetadata] = build_attention_metadata,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata for sequences in any order, batched shortest query first (as the runner orders
    its batch: decodes lead); (meta, rows, back).

    The caller's flat rows (sequence after sequence, in its order) run in the batch as
    ``x[rows]``, and a batch-ordered output goes back to the caller's order as ``out[back]``
    (both [T] int64 on ``device``). Drafters use this; the runner orders its own batch.
    ``build`` makes the ordered batch's metadata: pass a backend's ``build_metadata`` so a
    backend with its own layout gets it here too.
    """
    order = sorted(range(len(query_lens)), key=lambda i: query_lens[i])
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    rows = torch.tensor(
        [r for i in order for r in range(starts[i], starts[i + 1])], dtype=torch.int64
    )
    back = torch.empty_like(rows)
    back[rows] = torch.arange(len(rows))
    meta = build(
        [query_lens[i] for i in order], [seq_lens[i] for i in order],
        [block_tables[i] for i in order], block_size, device,
    )  # fmt: skip
    return meta, rows.to(device), back.to(device)
