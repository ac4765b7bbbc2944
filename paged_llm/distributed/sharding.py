"""How tensors are split across tensor-parallel ranks: contiguous ranges of output rows, input
columns, vocabulary entries and attention heads, and the checkpoint filter that keeps each
rank's slice of every full Hugging Face tensor."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from paged_llm.distributed.parallel_state import TPGroup, current_group

# vLLM's DEFAULT_VOCAB_PADDING_SIZE: each rank's vocabulary slice is a multiple of 64 rows, so
# any vocabulary splits (padding rows are never looked up, and their logits are cut off).
VOCAB_PADDING = 64


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows one rank holds: ids [start, start + size) of the vocabulary padded to
    a multiple of ``VOCAB_PADDING * ranks``; the first ``num_real`` are real tokens' rows."""

    start: int
    size: int
    num_real: int
    padded_vocab_size: int

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows [size, ...] of a full [vocab, ...] tensor, zeros past the vocabulary
        (a view of the checkpoint tensor when the rank holds no padding)."""
        rows = full.narrow(0, min(self.start, full.shape[0]), self.num_real)
        if self.num_real == self.size:
            return rows
        pad = rows.new_zeros((self.size - self.num_real, *rows.shape[1:]))
        return torch.cat([rows, pad])


def shard_vocab(vocab_size: int, group: TPGroup) -> VocabShard:
    """This rank's slice of the vocabulary padded as vLLM pads it (VocabParallelEmbedding)."""
    multiple = VOCAB_PADDING * group.size
    padded = -(-vocab_size // multiple) * multiple
    size = padded // group.size
    start = group.rank * size
    return VocabShard(start, size, max(0, min(size, vocab_size - start)), padded)


def even_split(total: int, group: TPGroup, what: str = "dimension") -> tuple[int, int]:
    """(start, size) of this rank's contiguous 1/size share of ``total`` items."""
    if total % group.size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size={group.size}")
    size = total // group.size
    return group.rank * size, size


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: query heads [first_q, first_q + num_heads) and the
    K/V heads [first_kv, first_kv + num_kv_heads) those query heads read."""

    num_heads: int
    num_kv_heads: int
    first_kv_head: int

    def kv_rows(self, head_dim: int) -> tuple[int, int]:
        """(start, size) of this rank's rows of k_proj / v_proj (head-major HF layout)."""
        return self.first_kv_head * head_dim, self.num_kv_heads * head_dim


def shard_heads(num_heads: int, num_kv_heads: int, group: TPGroup | None = None) -> HeadShard:
    """Split query heads evenly; split K/V heads with them, or, when there are fewer K/V heads
    than ranks, give each rank (a replica of) the one K/V head its query heads share."""
    group = group or current_group()
    _, local_heads = even_split(num_heads, group, "num_attention_heads")
    local_kv = kv_heads_per_rank(num_kv_heads, group.size)
    # Query head q reads K/V head q // (num_heads // num_kv_heads); this rank's first query head
    # is rank * local_heads, so its first K/V head is rank * num_kv_heads // size.
    return HeadShard(local_heads, local_kv, group.rank * num_kv_heads // group.size)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """K/V heads each rank keeps: an even share, or one replicated head when too few."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) is not divisible by "
                f"tensor_parallel_size={tp_size}"
            )
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} is not a multiple of num_key_value_heads "
            f"({num_kv_heads}), so K/V heads cannot be replicated evenly"
        )
    return 1


def shard_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str | None, torch.Tensor]]
) -> Iterable[tuple[str | None, torch.Tensor]]:
    """Replace each full checkpoint tensor of a tensor-parallel layer by this rank's slice
    (a view: only the slice is copied into the model). Unsplit models pass through untouched."""
    owners = {n: m for n, m in model.named_modules() if hasattr(m, "shard_weight")}
    if not owners:
        return weights
    return _sharded(owners, weights)


def _sharded(
    owners: dict[str, nn.Module], weights: Iterable[tuple[str | None, torch.Tensor]]
) -> Iterator[tuple[str | None, torch.Tensor]]:
    for name, tensor in weights:
        if name is not None:
            module_name, _, param = name.rpartition(".")
            owner = owners.get(module_name)
            if owner is not None:
                tensor = owner.shard_weight(param, tensor)
        yield name, tensor


def replicated_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Parameters every rank holds whole (norms, OPT's positions, row-parallel biases, ...):
    those of plain modules, and those a parallel layer does not list in ``split_params``."""
    params: dict[int, torch.Tensor] = {}
    for module in model.modules():
        split = getattr(module, "split_params", ())
        for name, p in module.named_parameters(recurse=False):
            if name not in split:
                params.setdefault(id(p), p)
    split_ids = {
        id(p)
        for m in model.modules()
        for n, p in m.named_parameters(recurse=False)
        if n in getattr(m, "split_params", ())
    }
    return [p for i, p in params.items() if i not in split_ids]  # a tied head is split too
