"""Mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each
token's top-k experts and the token's output is their routing-weighted sum.

The experts' weights are stacked as transformers (v5) keeps them in memory, so the fused kernel
reads one tensor per projection: ``experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows,
then its up rows) and ``experts.down_proj`` [E, H, I]. Checkpoints store one tensor per expert
and projection; :func:`stack_expert_weights` stacks them while the checkpoint streams in.

With ``quantization="int8"`` (or ``"fp8"``) the two stacked tensors hold int8 (fp8 e4m3) values
and ``*_scale`` one float32 scale per expert and output channel; with ``"int4_rtn"`` they hold
two int4 codes per byte ([E, N, K/2] uint8) and ``*_scale`` / ``*_zero`` a scale and a zero
point per expert, output channel and group of inputs ([E, N, G]) (``quant/experts.py``).
Routers stay in float (a rounded router picks other experts).

Under tensor parallelism every rank holds every expert, with a 1/N slice of each expert's
intermediate features (gate/up rows column-parallel, down columns row-parallel, as a dense
MLP is split), and the partial outputs are all-reduced. With expert parallelism
(``enable_expert_parallel``) rank r instead holds experts [r E/N, (r+1) E/N) whole; every rank
routes every token (the router is replicated), runs only the pairs routed to its own experts
(the others' ids become -1, which the kernels skip), and the outputs are all-reduced.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.distributed.parallel_state import all_reduce, current_group
from paged_llm.distributed.sharding import even_split
from paged_llm.ops.moe import fused_experts, select_experts


class FusedExperts(nn.Module):
    """E SwiGLU experts in two stacked tensors; ``forward`` runs each token through its top-k."""

    split_params = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = current_group()
        self.full_intermediate_size = intermediate_size
        self.expert_parallel = self.tp.expert_parallel and self.tp.size > 1
        if self.expert_parallel:
            self.expert_start, local = even_split(num_experts, self.tp, "num_experts")
            self.inter_start, inter = 0, intermediate_size
        else:
            local = num_experts
            self.inter_start, inter = even_split(
                intermediate_size, self.tp, "moe_intermediate_size"
            )
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, inter))
        # [E, 2I] and [E, H] once int8 / fp8-quantized ([E, 2I, G] and [E, H, G] with int4,
        # beside the zeros); buffers, so they move with the module
        for name in ("gate_up_scale", "down_scale", "gate_up_zero", "down_zero"):
            self.register_buffer(name, None, persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int64
    ) -> torch.Tensor:  # [T, H]
        """The routing-weighted sum of each token's experts (summed over ranks under TP)."""
        if self.expert_parallel:  # global expert ids -> this rank's, -1 for another rank's
            local = topk_ids - self.expert_start
            mine = (local >= 0) & (local < self.gate_up_proj.shape[0])
            topk_ids = torch.where(mine, local, -1)
        out = fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                            self.gate_up_scale, self.down_scale, self.gate_up_zero,
                            self.down_zero)  # fmt: skip
        return all_reduce(out) if self.tp.size > 1 else out

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full [E, 2I, H] gate_up or [E, H, I] down: its experts (expert
        parallel), or its intermediate slice of every expert."""
        if full.shape == getattr(self, name).shape:
            return full  # one rank, or already this rank's (int4 experts stacked from slices)
        if self.expert_parallel:
            return full.narrow(0, self.expert_start, self.gate_up_proj.shape[0])
        inter = self.down_proj.shape[2]
        if name == "down_proj":
            return full.narrow(2, self.inter_start, inter)
        gate_rows = full.narrow(1, self.inter_start, inter)
        up_rows = full.narrow(1, self.full_intermediate_size + self.inter_start, inter)
        return torch.cat([gate_rows, up_rows], dim=1)

    def num_weights(self) -> int:
        """Weights of this rank's experts, however they are stored (int4 packs two a byte)."""
        e, two_i, _ = self.gate_up_proj.shape
        return e * self.down_proj.shape[1] * two_i * 3 // 2  # gate and up [2I, H], down [H, I]

    def extra_repr(self) -> str:
        e, two_i, _ = self.gate_up_proj.shape
        h = self.down_proj.shape[1]
        return f"num_experts={e}, hidden={h}, intermediate={two_i // 2} (this rank)"


class RouterLinear(nn.Linear):
    """A gate's linear layer (the router, Qwen2-MoE's shared-expert gate): plain ``nn.Linear``
    math, a type of its own so weight quantization (which swaps exact ``nn.Linear``) keeps it
    in float, as vLLM does."""


class SparseMoeBlock(nn.Module):
    """Router (``gate``, [E, H], replicated) + :class:`FusedExperts`, and optionally Qwen2-MoE's
    shared expert, added to every token scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(
        self,
        config: Any,
        num_experts: int,
        intermediate_size: int,
        renormalize: bool,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"mixture-of-experts layers support hidden_act='silu' only, not "
                f"'{config.hidden_act}'"
            )
        self.top_k = config.num_experts_per_tok
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of "
                f"experts ({num_experts})"
            )
        self.renormalize = renormalize
        self.gate = RouterLinear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, config.hidden_size, intermediate_size)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = RouterLinear(config.hidden_size, 1, bias=False)
        self.has_shared_expert = shared_expert is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Route, run the chosen experts, add the gated shared expert if there is one."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.has_shared_expert:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stack_expert_weights(
    weights: Iterable[tuple[str | None, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str | None, torch.Tensor]]:
    """Pass tensors through, but collect ``<prefix>.experts.<e>.{gate,up,down}_proj.weight`` and
    yield each layer's ``<prefix>.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
    once all its experts have arrived. Raises ValueError for missing or out-of-range experts."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in weights:
        match = _EXPERT_TENSOR.match(name) if name is not None else None
        if match is None or match["proj"] not in _PROJECTIONS:
            yield name, tensor
            continue
        expert = int(match["expert"])
        if expert >= num_experts:
            raise ValueError(f"checkpoint tensor '{name}' names expert {expert}, but the config "
                             f"has {num_experts} experts")  # fmt: skip
        parts = pending.setdefault(match["prefix"], {})
        parts[expert, match["proj"]] = tensor
        if len(parts) == 3 * num_experts:
            del pending[match["prefix"]]
            yield from _stacked(match["prefix"], parts, num_experts)
    for prefix, parts in pending.items():
        missing = [f"{e}.{p}" for e in range(num_experts) for p in _PROJECTIONS
                   if (e, p) not in parts]  # fmt: skip
        raise ValueError(f"checkpoint lacks expert tensors of {prefix}: {', '.join(missing[:6])}")


def _stacked(
    prefix: str, parts: dict[tuple[int, str], torch.Tensor], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The two stacked tensors of one layer's experts."""
    experts = range(num_experts)
    gate_up = torch.stack(
        [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in experts]
    )
    yield f"{prefix}.gate_up_proj", gate_up
    yield f"{prefix}.down_proj", torch.stack([parts[e, "down_proj"] for e in experts])
