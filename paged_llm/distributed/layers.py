"""Tensor-parallel layers (Megatron-LM's split, as vLLM uses it) and the factories models call.

At world size 1 the factories return plain ``nn.Linear`` / ``nn.Embedding``, so the single-
process model is exactly what it was (and quantization, which swaps plain ``nn.Linear``
modules, still finds them). At world size N:

* ``column_linear``: each rank computes a contiguous slice of the output features
  (q/k/v, gate/up, OPT fc1); bias sliced alike; no communication.
* ``row_linear``: each rank multiplies its slice of the input features (o_proj, down_proj, OPT
  out_proj/fc2) and the partial sums are all-reduced; the bias is added once, after the sum.
* ``vocab_embedding``: each rank holds a contiguous slice of the vocabulary, padded as vLLM
  pads it (to a multiple of 64 rows a rank), so any vocabulary size splits; rows of other
  ranks' tokens are zero, and an all-reduce assembles the embeddings.
* ``lm_head``: each rank scores its vocabulary slice; rank 0 gathers the full logits and cuts
  off the padding.

Each parallel layer knows how to cut its slice from a full checkpoint tensor (``shard_weight``)
and names its split parameters (``split_params``); every other parameter is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.distributed.parallel_state import (
    TPGroup,
    all_reduce,
    current_group,
    gather_to_driver,
)
from paged_llm.distributed.sharding import even_split, shard_vocab


class ColumnParallelLinear(nn.Linear):
    """``x [T, in] -> [T, rows]``: this rank's output rows of a full [out, in] weight."""

    split_params = ("weight", "bias")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: TPGroup,
        rows: tuple[int, int] | None = None,  # (start, size); default: an even 1/N share
    ) -> None:
        self.row_start, size = rows or even_split(out_features, group, "output features")
        super().__init__(in_features, size, bias=bias)
        self.full_features = (in_features, out_features)
        self.tp = group

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Rows [start, start + size) of the full weight [out, in] or bias [out]."""
        return full.narrow(0, self.row_start, self.out_features)

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA pair for this rank: A [r, in] whole, B's rows [start, start + size)."""
        return a, b.narrow(0, self.row_start, self.out_features)


class RowParallelLinear(nn.Linear):
    """``x [T, in/N] -> [T, out]``: partial products summed over ranks, then the bias."""

    split_params = ("weight",)

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup) -> None:
        self.col_start, size = even_split(in_features, group, "input features")
        super().__init__(size, out_features, bias=bias)
        self.full_features = (in_features, out_features)
        self.tp = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/N] -> [T, out]
        """Multiply this rank's columns, all-reduce, add the (replicated) bias once."""
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/N] -> [T, out], this rank's
        """This rank's share of the product, before the sum over ranks."""
        return F.linear(x, self.weight)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:  # [T, out] partial -> [T, out]
        """Sum the ranks' partial products; add the bias once."""
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Columns [start, start + size) of the weight [out, in]; the bias [out] stays whole."""
        return full.narrow(1, self.col_start, self.in_features) if name == "weight" else full

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA pair for this rank: A's columns [start, start + size), B [out, r] whole (the
        ranks' partial deltas then sum to the whole one, as the partial products do)."""
        return a.narrow(1, self.col_start, self.in_features), b


class VocabParallelEmbedding(nn.Embedding):
    """``ids [T] -> [T, H]`` from this rank's slice of the vocabulary, summed over ranks."""

    split_params = ("weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int, group: TPGroup) -> None:
        self.shard = shard_vocab(num_embeddings, group)
        self.vocab_start = self.shard.start
        super().__init__(self.shard.size, embedding_dim)  # padding rows stay zero, never read
        self.tp = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """Look up own tokens, zero the others', all-reduce (exactly one rank adds each row)."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Rows [start, start + size) of the full [vocab, H] table, zeros past the vocabulary."""
        return self.shard.cut(full)


class ParallelLMHead(nn.Linear):
    """``hidden [N, H] -> logits [N, V]`` on rank 0 (other ranks get their [N, V_pad/size]
    slice). The padded vocabulary's extra logits are cut off on rank 0, so no sampler, logprob
    or logits processor ever sees them."""

    split_params = ("weight",)

    def __init__(self, in_features: int, vocab_size: int, group: TPGroup) -> None:
        self.shard = shard_vocab(vocab_size, group)
        self.vocab_start = self.shard.start
        self.vocab_size = vocab_size
        super().__init__(in_features, self.shard.size, bias=False)
        self.tp = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] on rank 0
        """Score this rank's vocabulary slice; gather the slices, in rank order, on rank 0."""
        logits = gather_to_driver(F.linear(x, self.weight), self.tp)  # [N, V_pad] on rank 0
        return logits[:, : self.vocab_size] if self.tp.is_driver else logits

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Rows [start, start + size) of the full [vocab, H] head, zeros past the vocabulary."""
        return self.shard.cut(full)


# ---- factories: what model files call -------------------------------------------------------
def column_linear(
    in_features: int, out_features: int, bias: bool, rows: tuple[int, int] | None = None
) -> nn.Linear:
    """A linear layer whose output features are split across ranks (nn.Linear at size 1)."""
    group = current_group()
    if group.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, bias, group, rows)


def row_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """A linear layer whose input features are split across ranks (nn.Linear at size 1)."""
    group = current_group()
    if group.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, group)


def vocab_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """A token embedding split by vocabulary across ranks (nn.Embedding at size 1)."""
    group = current_group()
    if group.size == 1:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, group)


def lm_head(in_features: int, vocab_size: int) -> nn.Linear:
    """The bias-free LM head, split by vocabulary across ranks (nn.Linear at size 1)."""
    group = current_group()
    if group.size == 1:
        return nn.Linear(in_features, vocab_size, bias=False)
    return ParallelLMHead(in_features, vocab_size, group)
