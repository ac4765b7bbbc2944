"""Pre-quantized mixture-of-experts checkpoints: AutoGPTQ and AutoAWQ store one int4 layer per
expert and projection (Mixtral's ``block_sparse_moe.experts.<e>.w1``, Qwen-MoE's
``mlp.experts.<e>.gate_proj``); the model stacks its experts (``layers/moe.FusedExperts``).
Reading collects the per-expert layers and stacks them into int4 experts; writing splits them
again under the checkpoint's names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_llm.layers.moe import FusedExperts
from paged_llm.ops.moe.reference import pack_int4_experts
from paged_llm.quant.checkpoint_format import QUANT_SUFFIXES, CheckpointLayer, gptq_layout
from paged_llm.quant.experts import check_int4_expert_group, int4_experts, set_int4_experts
from paged_llm.quant.layers import Int4Linear
from paged_llm.quant.packing import unpack_int4

_EXPERT_LAYER = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)_proj$")
_PROJECTIONS = {"gate": "gate_up", "up": "gate_up", "down": "down"}  # ours, stacked


@dataclass(frozen=True)
class _ExpertSlice:
    """What of a checkpoint's experts one FusedExperts (this rank's) holds."""

    first_expert: int  # expert parallelism: this rank's first expert; else 0
    num_experts: int  # local
    inter_start: int  # tensor parallelism: this rank's first intermediate feature; else 0
    inter: int  # local intermediate features
    full_inter: int
    hidden: int


class Int4ExpertLoader:
    """Collects a checkpoint's per-expert int4 layers (``...experts.<e>.{gate,up,down}_proj``
    under our names) and stacks them into each FusedExperts at the end of the stream. Under
    tensor parallelism a rank keeps its experts (expert parallelism) or its slice of every
    expert's intermediate features: gate/up rows and down's groups of input columns."""

    def __init__(self, model: nn.Module, parts: dict[str, tuple[str, int, str]], fmt: Any):
        self.parts, self.fmt = parts, fmt  # checkpoint layer -> (our module, expert, proj)
        self.slices: dict[str, _ExpertSlice] = {}
        for module_name in {module for module, _, _ in parts.values()}:
            experts = model.get_submodule(module_name)
            e, two_i, h = experts.gate_up_proj.shape
            ep = experts.expert_parallel
            self.slices[module_name] = _ExpertSlice(
                experts.expert_start if ep else 0, e, experts.inter_start, two_i // 2,
                experts.full_intermediate_size, h,
            )  # fmt: skip
            device = experts.gate_up_proj.device
            full_i = experts.full_intermediate_size
            for name, n, k, full_k in (("gate_up", two_i, h, h), ("down", h, two_i // 2, full_i)):
                group = fmt.layer_group_size(full_k)
                what = f"{module_name}'s {name} projection"
                check_int4_expert_group(group, k, what + (" on this rank" if k != full_k else ""))
                zero = torch.zeros(e, n, k // group, device=device)  # a shell the checkpoint fills
                codes = torch.zeros(e, n, k, dtype=torch.uint8, device=device)
                set_int4_experts(experts, name, codes, zero, zero)
        self.tensors: dict[tuple[str, int, str, str], torch.Tensor] = {}
        self.modules = {name: model.get_submodule(name) for name in self.slices}

    def layer(self, prefix: str) -> CheckpointLayer:
        """The (full) sizes of one expert's projection in the checkpoint."""
        module, _, proj = self.parts[prefix]
        piece = self.slices[module]
        k, n = (
            (piece.full_inter, piece.hidden) if proj == "down" else (piece.hidden, piece.full_inter)
        )
        return CheckpointLayer(k, n, ())

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``name`` if it is an expert's int4 tensor (in the GPTQ layout); else False.
        Another rank's expert is taken and dropped."""
        prefix, _, suffix = name.rpartition(".")
        if prefix not in self.parts or suffix not in QUANT_SUFFIXES:
            return False
        module, expert, proj = self.parts[prefix]
        tensor = gptq_layout(name, suffix, tensor, self.layer(prefix), self.fmt)
        local = expert - self.slices[module].first_expert
        if 0 <= local < self.slices[module].num_experts:
            self.tensors[module, local, proj, suffix] = tensor
        return True

    def finish(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each FusedExperts' stacked int4 weights (its scales and zeros set in place)."""
        for module, piece in self.slices.items():
            stacked: dict[str, list[list[torch.Tensor]]] = {"gate_up": [], "down": []}
            for expert in range(piece.num_experts):
                rows = {"gate_up": [], "down": []}
                for proj in ("gate", "up", "down"):
                    rows[_PROJECTIONS[proj]].append(self._codes(module, expert, proj))
                for name, parts in rows.items():
                    stacked[name].append([torch.cat(p) for p in zip(*parts)])  # along N
            experts = self.modules[module]
            for name, per_expert in stacked.items():
                codes, scales, zeros = (torch.stack(t) for t in zip(*per_expert))
                device = getattr(experts, f"{name}_proj").device
                setattr(experts, f"{name}_scale", scales.float().contiguous().to(device))
                setattr(experts, f"{name}_zero", zeros.to(torch.uint8).contiguous().to(device))
                yield f"{module}.{name}_proj", pack_int4_experts(codes)

    def _codes(self, module: str, expert: int, proj: str) -> tuple[torch.Tensor, ...]:
        """(codes [N, K], scales [N, G], zeros [N, G]) of this rank's part of one expert's
        projection (``expert`` is the local index)."""
        piece = self.slices[module]
        name = f"{module}.{piece.first_expert + expert}.{proj}_proj"
        got = {s: self.tensors.get((module, expert, proj, s)) for s in QUANT_SUFFIXES}
        missing = [s for s in ("qweight", "qzeros", "scales") if got[s] is None]
        if missing:
            raise ValueError(f"checkpoint lacks {name}.{missing[0]} (int4 experts)")
        k = got["qweight"].shape[0] * 8
        group = self.fmt.layer_group_size(k)
        g_idx = got["g_idx"]
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise ValueError(
                f"{name} has an act-order g_idx: int4 experts need the plain group order "
                "(desc_act=False)"
            )
        codes = unpack_int4(got["qweight"], dim=0).t()  # [N, K]
        zeros = (unpack_int4(got["qzeros"], dim=1) + self.fmt.zero_offset).t()  # [N, G]
        scales = got["scales"].float().t()  # [N, G]
        start, size = piece.inter_start, piece.inter  # this rank's intermediate features
        if proj != "down":  # gate / up: output rows
            return (
                codes[start : start + size],
                scales[start : start + size],
                zeros[start : start + size],
            )
        groups = slice(start // group, (start + size) // group)  # down: whole groups of inputs
        return codes[:, start : start + size], scales[:, groups], zeros[:, groups]


def expert_parts(model: nn.Module, layers: list[str]) -> dict[str, tuple[str, int, str]]:
    """The checkpoint layers among ``layers`` that are one expert's projection of a
    FusedExperts: name -> (our module, expert, "gate" | "up" | "down")."""
    parts = {}
    for name in layers:
        ours = model.checkpoint_name(name + ".weight")  # e.g. Mixtral's w1 -> gate_proj
        match = _EXPERT_LAYER.match(ours.removesuffix(".weight")) if ours else None
        if match is None or match["proj"] not in _PROJECTIONS:
            continue
        try:
            module = model.get_submodule(match["module"])
        except AttributeError:
            continue
        if isinstance(module, FusedExperts):
            parts[name] = (match["module"], int(match["expert"]), match["proj"])
    return parts


def expert_int4_layers(model: nn.Module, name: str, experts: nn.Module) -> dict[str, Int4Linear]:
    """A FusedExperts' int4 weights as the checkpoint stores them: one layer per expert and
    projection, under the checkpoint's names (``model.export_name``)."""
    gate_up, down = int4_experts(experts, "gate_up"), int4_experts(experts, "down")
    inter = gate_up[0].shape[1] // 2
    out = {}
    for e in range(gate_up[0].shape[0]):
        for proj, (codes, scales, zeros), rows in (
            ("gate", gate_up, slice(0, inter)),
            ("up", gate_up, slice(inter, 2 * inter)),
            ("down", down, slice(None)),
        ):
            q, s, z = codes[e, rows], scales[e, rows], zeros[e, rows]  # [N, K], [N, G], [N, G]
            layer = Int4Linear.from_quantized(q, s.t(), z.t(), q.shape[1] // s.shape[1])
            checkpoint = model.export_name(f"{name}.{e}.{proj}_proj.weight")
            out[checkpoint.removesuffix(".weight")] = layer
    return out
