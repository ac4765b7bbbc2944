"""Pre-quantized Hugging Face checkpoints: reading (and, for tests and tools, writing) the GPTQ
and AWQ layouts of :mod:`paged_llm.quant.packing`.

A checkpoint is pre-quantized when its config.json has a ``quantization_config`` with
``quant_method`` "gptq" or "awq". Its quantized layers are found from the tensors themselves
(every ``<layer>.qweight``), swapped for :class:`Int4Linear` shells, and filled by the normal
weight loader; AWQ tensors are repacked into the GPTQ layout on the way (a lossless reorder).
A mixture-of-experts checkpoint stores one quantized layer per expert and projection; those
are collected and stacked into the model's int4 experts (``layers/moe.FusedExperts``).
Every mismatch between the config and the tensors raises an error naming the tensor.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from paged_llm.layers.moe import FusedExperts
from paged_llm.models.checkpoint import find_weight_files, iter_weight_files
from paged_llm.models.loader import instantiate_model, load_config, load_model
from paged_llm.models.registry import get_model_class
from paged_llm.ops.moe.reference import pack_int4_experts
from paged_llm.quant.base import set_module
from paged_llm.quant.experts import check_int4_expert_group, int4_experts, set_int4_experts
from paged_llm.quant.layers import Int4Linear
from paged_llm.quant.packing import AWQ_ORDER, pack_int4, unpack_int4

PREQUANTIZED_METHODS = ("gptq", "awq")
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class CheckpointFormat:
    """What a checkpoint's quantization_config says about its int4 tensors."""

    method: str  # "gptq" | "awq"
    group_size: int  # -1: one group per row (as GPTQ writes it)
    zero_offset: int  # added to stored zeros: 1 for GPTQ's zero-minus-one, else 0

    def layer_group_size(self, in_features: int) -> int:
        """The group size of a layer with ``in_features`` inputs."""
        return in_features if self.group_size == -1 else self.group_size


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization_config as a dict, or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def prequantized_method(hf_config: Any) -> str | None:
    """ "gptq" / "awq" when the checkpoint is pre-quantized in that layout, else None."""
    qc = quantization_config(hf_config)
    return None if qc is None else str(qc.get("quant_method", "")).lower() or None


def parse_format(qc: dict[str, Any]) -> CheckpointFormat:
    """Validate a GPTQ / AWQ quantization_config; raise naming anything unsupported."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in PREQUANTIZED_METHODS:
        raise ValueError(
            f"checkpoint quantization_config has quant_method '{method}'; supported: "
            f"{list(PREQUANTIZED_METHODS)}"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with bits={bits}: only 4-bit is supported")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ checkpoint version '{version}': only the GEMM layout is supported"
            )
        if not qc.get("zero_point", True):
            raise ValueError("AWQ checkpoint without zero points is not supported")
        return CheckpointFormat("awq", group_size, zero_offset=0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format '{fmt}' is not supported (gptq, gptq_v2)")
    return CheckpointFormat("gptq", group_size, zero_offset=1 if fmt == "gptq" else 0)


def _tensor_names(files: list[Path]) -> list[str]:
    """All tensor names of a checkpoint (without reading safetensors data)."""
    names: list[str] = []
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names.extend(f.keys())
        else:
            names.extend(name for name, _ in iter_weight_files([path]))
    return names


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...], fmt: CheckpointFormat) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but the {fmt.method} quantization_config "
            f"(bits=4, group_size={fmt.group_size}) implies {shape} for this layer"
        )


@dataclass(frozen=True)
class CheckpointLayer:
    """One int4 layer as the checkpoint stores it, and the layers of ours that hold its output
    rows: itself (rows None), or the parts of a layer the checkpoint fuses (GPT-2's c_attn)."""

    in_features: int
    out_features: int
    parts: tuple[tuple[str, torch.Tensor | None], ...]


def _gptq_layout(
    name: str, suffix: str, tensor: torch.Tensor, layer: CheckpointLayer, fmt: CheckpointFormat
) -> torch.Tensor:
    """One int4 tensor of ``layer``, shape-checked against the quantization config, in the
    GPTQ layout (AWQ's interleaved nibbles reordered)."""
    k, n = layer.in_features, layer.out_features
    groups = k // fmt.layer_group_size(k)
    if suffix == "scales":
        _expect(name, tensor, (groups, n), fmt)
    elif suffix == "g_idx":
        _expect(name, tensor, (k,), fmt)
        if int(tensor.min()) < 0 or int(tensor.max()) >= groups:
            raise ValueError(
                f"{name} indexes groups {int(tensor.min())}..{int(tensor.max())} but the "
                f"{fmt.method} quantization_config (group_size={fmt.group_size}) implies "
                f"{groups} groups for this layer"
            )
    elif fmt.method == "gptq":
        _expect(name, tensor, (k // 8, n) if suffix == "qweight" else (groups, n // 8), fmt)
    elif suffix == "qweight":  # AWQ: [K, N/8] interleaved -> GPTQ [K/8, N]
        _expect(name, tensor, (k, n // 8), fmt)
        tensor = pack_int4(unpack_int4(tensor, dim=1, order=AWQ_ORDER), dim=0)
    else:  # AWQ qzeros: same shape as GPTQ's, columns interleaved
        _expect(name, tensor, (groups, n // 8), fmt)
        tensor = pack_int4(unpack_int4(tensor, dim=1, order=AWQ_ORDER), dim=1)
    return tensor


def _output_rows(suffix: str, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The part of a GPTQ-layout tensor that holds output features ``rows`` (columns here;
    g_idx, over the inputs, is every part's)."""
    if suffix == "g_idx":
        return tensor
    if suffix == "qzeros":  # eight outputs per int32: unpack, select, pack again
        return pack_int4(unpack_int4(tensor, dim=1)[:, rows], dim=1)
    return tensor[:, rows].contiguous()


_EXPERT_LAYER = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)_proj$")
_PROJECTIONS = {"gate": "gate_up", "up": "gate_up", "down": "down"}  # ours, stacked


class Int4ExpertLoader:
    """Collects a checkpoint's per-expert int4 layers (``...experts.<e>.{gate,up,down}_proj``
    under our names) and stacks them into each FusedExperts at the end of the stream."""

    def __init__(self, model: nn.Module, parts: dict[str, tuple[str, int, str]], fmt: Any):
        self.parts, self.fmt = parts, fmt  # checkpoint layer -> (our module, expert, proj)
        self.sizes: dict[str, tuple[int, int, int]] = {}  # module -> (E, I, H)
        for module_name in {module for module, _, _ in parts.values()}:
            experts = model.get_submodule(module_name)
            e, two_i, h = experts.gate_up_proj.shape
            device = experts.gate_up_proj.device
            self.sizes[module_name] = (e, two_i // 2, h)
            for name, n, k in (("gate_up", two_i, h), ("down", h, two_i // 2)):
                group = fmt.layer_group_size(k)
                check_int4_expert_group(group, k, f"{module_name}'s {name} projection")
                zero = torch.zeros(e, n, k // group, device=device)  # a shell the checkpoint fills
                codes = torch.zeros(e, n, k, dtype=torch.uint8, device=device)
                set_int4_experts(experts, name, codes, zero, zero)
        self.tensors: dict[tuple[str, int, str, str], torch.Tensor] = {}
        self.modules = {name: model.get_submodule(name) for name in self.sizes}

    def layer(self, prefix: str) -> CheckpointLayer:
        """The sizes of one expert's projection."""
        module, _, proj = self.parts[prefix]
        _, inter, hidden = self.sizes[module]
        k, n = (inter, hidden) if proj == "down" else (hidden, inter)
        return CheckpointLayer(k, n, ())

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``name`` if it is an expert's int4 tensor (in the GPTQ layout); else False."""
        prefix, _, suffix = name.rpartition(".")
        if prefix not in self.parts or suffix not in QUANT_SUFFIXES:
            return False
        module, expert, proj = self.parts[prefix]
        tensor = _gptq_layout(name, suffix, tensor, self.layer(prefix), self.fmt)
        self.tensors[module, expert, proj, suffix] = tensor
        return True

    def finish(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each FusedExperts' stacked int4 weights (its scales and zeros set in place)."""
        for module, (num_experts, _, _) in self.sizes.items():
            stacked: dict[str, list[list[torch.Tensor]]] = {"gate_up": [], "down": []}
            for expert in range(num_experts):
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
        """(codes [N, K], scales [N, G], zeros [N, G]) of one expert's projection."""
        got = {s: self.tensors.get((module, expert, proj, s)) for s in QUANT_SUFFIXES}
        missing = [s for s in ("qweight", "qzeros", "scales") if got[s] is None]
        if missing:
            raise ValueError(
                f"checkpoint lacks {module}.{expert}.{proj}_proj.{missing[0]} (int4 experts)"
            )
        k = got["qweight"].shape[0] * 8
        g_idx = got["g_idx"]
        if g_idx is not None and not torch.equal(
            g_idx.long(), torch.arange(k) // self.fmt.layer_group_size(k)
        ):
            raise ValueError(
                f"{module}.{expert}.{proj}_proj has an act-order g_idx: int4 experts need the "
                "plain group order (desc_act=False)"
            )
        codes = unpack_int4(got["qweight"], dim=0).t()  # [N, K]
        zeros = (unpack_int4(got["qzeros"], dim=1) + self.fmt.zero_offset).t()  # [N, G]
        return codes, got["scales"].float().t(), zeros


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


def translate(
    weights: Iterable[tuple[str, torch.Tensor]],
    shells: dict[str, Int4Linear],
    layers: dict[str, CheckpointLayer],
    fmt: CheckpointFormat,
    experts: Int4ExpertLoader | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors -> our parameter names and GPTQ layout, shape-checked against the
    quantization config, fused layers split into our ``shells``, experts' layers stacked into
    their FusedExperts; g_idx is supplied where the checkpoint has none (AWQ)."""
    has_g_idx: set[str] = set()
    for name, tensor in weights:
        if experts is not None and experts.take(name, tensor):
            continue
        prefix, _, suffix = name.rpartition(".")
        layer = layers.get(prefix)
        if layer is None or suffix not in QUANT_SUFFIXES:
            yield name, tensor
            continue
        tensor = _gptq_layout(name, suffix, tensor, layer, fmt)
        for part, rows in layer.parts:
            has_g_idx.update([part] if suffix == "g_idx" else [])
            yield f"{part}.{suffix}", tensor if rows is None else _output_rows(suffix, tensor, rows)
    for part, shell in shells.items():
        if part not in has_g_idx:
            yield f"{part}.g_idx", shell.g_idx.detach().clone()  # plain k // group_size
    if experts is not None:
        yield from experts.finish()


def _linear(model: nn.Module, name: str, checkpoint_layer: str) -> nn.Linear:
    """Our float linear layer ``name``, which holds (part of) ``checkpoint_layer``."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"checkpoint has {checkpoint_layer}.qweight but the model has no layer {name}"
        ) from None
    if not isinstance(linear, nn.Linear):
        raise ValueError(
            f"{checkpoint_layer}.qweight belongs to {type(linear).__name__}, not a linear layer"
        )
    return linear


def load_checkpoint(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[nn.Module, Any]:
    """Load a checkpoint directory, plain or pre-quantized (GPTQ / AWQ): (model, HF config)."""
    model_dir = Path(model_dir).expanduser().resolve()
    hf_config = load_config(model_dir)
    qc = quantization_config(hf_config)
    if qc is None:
        return load_model(model_dir, dtype, device)
    fmt = parse_format(qc)
    get_model_class(hf_config)  # fail on an unsupported architecture before reading weights
    files = find_weight_files(model_dir)
    model = instantiate_model(hf_config, dtype, device)
    quantized = sorted(
        {n[: -len(".qweight")] for n in _tensor_names(files) if n.endswith(".qweight")}
    )
    if not quantized:
        raise ValueError(f"config.json says {fmt.method} but no tensor in {model_dir} is a qweight")
    of_experts = expert_parts(model, quantized)
    experts = Int4ExpertLoader(model, of_experts, fmt) if of_experts else None
    fused = model.fused_linears()
    shells: dict[str, Int4Linear] = {}
    layers: dict[str, CheckpointLayer] = {}
    for name in (n for n in quantized if n not in of_experts):
        parts = fused.get(name, [(name, None)])
        linears = [_linear(model, part, name) for part, _ in parts]
        for (part, _), linear in zip(parts, linears):
            k, n = linear.in_features, linear.out_features
            try:
                shell = Int4Linear.shell(
                    k, n, fmt.layer_group_size(k), linear.bias is not None, fmt.zero_offset
                )
            except ValueError as err:
                raise ValueError(
                    f"{part}: {err} (quantization_config group_size={fmt.group_size})"
                ) from None
            shells[part] = shell.to(device)
            set_module(model, part, shells[part])
        out_features = sum(linear.out_features for linear in linears)
        layers[name] = CheckpointLayer(linears[0].in_features, out_features, tuple(parts))
    model.load_weights(translate(iter_weight_files(files), shells, layers, fmt, experts))
    for shell in shells.values():
        shell.plain_groups = shell._plain_groups()  # g_idx came from the checkpoint
    return model.eval(), hf_config


def save_quantized(
    model: nn.Module, out_dir: str | Path, method: str = "gptq", tokenizer_dir: Path | None = None
) -> Path:
    """Write ``model`` (int4 layers + float rest) as a GPTQ- or AWQ-layout HF checkpoint."""
    if method not in PREQUANTIZED_METHODS:
        raise ValueError(f"method must be one of {list(PREQUANTIZED_METHODS)}, got '{method}'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    experts = {n: m for n, m in model.named_modules()
               if isinstance(m, FusedExperts) and m.gate_up_zero is not None}  # fmt: skip
    if not layers and not experts:
        raise ValueError("the model has no int4 layers to save")
    int4_layers = _checkpoint_int4_layers(model, layers)
    for name, module in experts.items():
        int4_layers.update(_expert_int4_layers(model, name, module))
    sizes = {m.group_size for m in int4_layers.values()}
    if len(sizes) != 1:
        raise ValueError(f"int4 layers use different group sizes {sorted(sizes)}")
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] in layers | experts:
            continue  # an int4 layer's tensors (its bias too) are written below
        if model.checkpoint_name(name) is not None:
            tensors[model.export_name(name)] = param.detach().cpu().contiguous()
    for prefix, layer in int4_layers.items():
        tensors.update(_layer_tensors(prefix, layer, method))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.quantization_config = _quant_config(method, sizes.pop())
    config.save_pretrained(str(out_dir))
    if tokenizer_dir is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tokenizer_dir) / f).is_file():
                (out_dir / f).write_bytes((Path(tokenizer_dir) / f).read_bytes())
    return out_dir


def _expert_int4_layers(model: nn.Module, name: str, experts: nn.Module) -> dict[str, Int4Linear]:
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


def _checkpoint_int4_layers(
    model: nn.Module, layers: dict[str, Int4Linear]
) -> dict[str, Int4Linear]:
    """The int4 layers under the checkpoint's names: the parts of a layer the checkpoint fuses
    (``model.fused_linears()``) joined into one."""
    out = dict(layers)
    for name, parts in model.fused_linears().items():
        held = [out.pop(part, None) for part, _ in parts]
        if all(layer is None for layer in held):
            continue
        if any(layer is None for layer in held):
            raise ValueError(f"{name}: only some of the layers it fuses are int4")
        out[name] = fuse_int4([(layer, rows) for layer, (_, rows) in zip(held, parts)])
    return out


def fuse_int4(parts: list[tuple[Int4Linear, torch.Tensor]]) -> Int4Linear:
    """One int4 layer whose output features ``rows`` are each part's (inputs, groups and
    g_idx shared): how a checkpoint stores q, k and v in one fused layer."""
    first = parts[0][0]
    for layer, _ in parts[1:]:
        same = (layer.in_features, layer.group_size, layer.zero_offset, layer.bias is None) == (
            first.in_features, first.group_size, first.zero_offset, first.bias is None
        )  # fmt: skip
        if not same or not torch.equal(layer.g_idx, first.g_idx):
            raise ValueError("int4 layers to fuse differ in inputs, groups, zeros or bias")
    n = sum(len(rows) for _, rows in parts)
    groups = first.scales.shape[0]
    q = torch.empty(first.in_features, n, dtype=torch.int32)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    scales = torch.empty(groups, n, dtype=torch.float16)
    bias = None if first.bias is None else torch.empty(n, dtype=first.bias.dtype)
    for layer, rows in parts:
        q[:, rows] = unpack_int4(layer.qweight.detach().cpu(), dim=0)
        zeros[:, rows] = unpack_int4(layer.qzeros.detach().cpu(), dim=1)
        scales[:, rows] = layer.scales.detach().cpu()
        if bias is not None:
            bias[rows] = layer.bias.detach().cpu()
    g_idx = first.g_idx.detach().cpu()
    return Int4Linear(pack_int4(q, dim=0), pack_int4(zeros, dim=1), scales, g_idx,
                      first.group_size, bias, first.zero_offset)  # fmt: skip


def _quant_config(method: str, group_size: int) -> dict[str, Any]:
    if method == "gptq":
        return {
            "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
            "sym": False, "checkpoint_format": "gptq",
        }  # fmt: skip
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm"}  # fmt: skip


def _layer_tensors(prefix: str, layer: Int4Linear, method: str) -> dict[str, torch.Tensor]:
    """One int4 layer's tensors in the GPTQ (v1) or AWQ layout."""
    q = unpack_int4(layer.qweight.detach().cpu(), dim=0)  # [K, N]
    zeros = unpack_int4(layer.qzeros.detach().cpu(), dim=1) + layer.zero_offset  # true zeros
    out = {f"{prefix}.scales": layer.scales.detach().cpu().to(torch.float16).contiguous()}
    if layer.bias is not None:
        out[f"{prefix}.bias"] = layer.bias.detach().cpu().contiguous()
    if method == "gptq":
        if int(zeros.min()) < 1:
            raise ValueError(f"{prefix}: zero point 0 cannot be stored in GPTQ format (z - 1)")
        out[f"{prefix}.qweight"] = pack_int4(q, dim=0)
        out[f"{prefix}.qzeros"] = pack_int4(zeros - 1, dim=1)
        out[f"{prefix}.g_idx"] = layer.g_idx.detach().cpu().to(torch.int32)
    else:
        if not layer.plain_groups:
            raise ValueError(f"{prefix}: act-order g_idx cannot be stored in AWQ format")
        if int(zeros.max()) > 15:
            raise ValueError(f"{prefix}: zero point 16 cannot be stored in AWQ format")
        out[f"{prefix}.qweight"] = pack_int4(q, dim=1, order=AWQ_ORDER)
        out[f"{prefix}.qzeros"] = pack_int4(zeros, dim=1, order=AWQ_ORDER)
    return out


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory as a dict (for tools and tests)."""
    return json.loads((Path(model_dir) / "config.json").read_text())
