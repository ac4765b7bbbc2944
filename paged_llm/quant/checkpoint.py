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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from paged_llm.distributed.layers import ColumnParallelLinear, RowParallelLinear
from paged_llm.layers.moe import FusedExperts
from paged_llm.models.checkpoint import find_weight_files, iter_weight_files
from paged_llm.models.loader import instantiate_model, load_config, load_model
from paged_llm.models.registry import get_model_class
from paged_llm.quant.base import set_module
from paged_llm.quant.checkpoint_format import (
    PREQUANTIZED_METHODS,
    QUANT_SUFFIXES,
    CheckpointFormat,
    CheckpointLayer,
    LayerPart,
    gptq_layout,
    input_cols,
    output_rows,
    parse_format,
    prequantized_method,
    quantization_config,
)
from paged_llm.quant.expert_checkpoint import Int4ExpertLoader, expert_int4_layers, expert_parts
from paged_llm.quant.layers import Int4Linear
from paged_llm.quant.packing import AWQ_ORDER, pack_int4, unpack_int4
from paged_llm.quant.parallel import RowParallelQuantLinear, rank_local

__all__ = [
    "PREQUANTIZED_METHODS",
    "load_checkpoint",
    "parse_format",
    "prequantized_method",
    "quantization_config",
    "save_quantized",
]


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
        if layer is None or suffix not in (*QUANT_SUFFIXES, "bias"):
            yield name, tensor
            continue
        if suffix == "bias":  # [N]: each part's rows (a row-parallel rank adds all of it)
            for part in layer.parts:
                yield part.bias, tensor if part.rows is None else tensor[part.rows]
            continue
        tensor = gptq_layout(name, suffix, tensor, layer, fmt)
        group = fmt.layer_group_size(layer.in_features)
        for part in layer.parts:
            if suffix == "g_idx":
                has_g_idx.add(part.prefix)
            local = tensor if part.rows is None else output_rows(suffix, tensor, part.rows)
            local = local if part.cols is None else input_cols(suffix, local, part.cols, group)
            yield f"{part.prefix}.{suffix}", local
    for part, shell in shells.items():
        if part not in has_g_idx:
            yield f"{part}.g_idx", shell.g_idx.detach().clone()  # plain k // group_size
    if experts is not None:
        yield from experts.finish()


def _full_inputs(linear: nn.Linear) -> int:
    """Input features of the whole layer (a row-parallel rank holds 1/N of them)."""
    return linear.in_features * (linear.tp.size if isinstance(linear, RowParallelLinear) else 1)


def _int4_shell(
    part: str, rows: torch.Tensor | None, linear: nn.Linear, fmt: CheckpointFormat
) -> tuple[nn.Module, Int4Linear, LayerPart, int]:
    """An empty int4 layer in place of our float ``linear`` (``part``; ``rows``: the output
    rows of the checkpoint's layer it holds), wrapped for tensor parallelism where ``linear``
    is split: (module to install, its Int4Linear, where the tensors go, the checkpoint rows
    this part covers on all ranks)."""
    k, n = linear.in_features, linear.out_features
    group = fmt.layer_group_size(_full_inputs(linear))
    row_parallel = isinstance(linear, RowParallelLinear)
    try:
        if row_parallel and k % group:
            raise ValueError(f"a rank's {k} inputs are not whole groups of {group}")
        shell = Int4Linear.shell(
            k, n, group, linear.bias is not None and not row_parallel, fmt.zero_offset
        )
    except ValueError as err:
        raise ValueError(
            f"{part}: {err} (quantization_config group_size={fmt.group_size})"
        ) from None
    covered = n if rows is None else len(rows)
    if row_parallel:  # inputs split: all-reduce, then the whole bias once
        cols = (linear.col_start, k)
        wrapper = RowParallelQuantLinear(shell, linear.bias)
        return wrapper, shell, LayerPart(f"{part}.quant", f"{part}.bias", rows, cols), covered
    if isinstance(linear, ColumnParallelLinear):  # this rank's rows of the part's outputs
        every = rows if rows is not None else torch.arange(n * linear.tp.size)
        mine = every[linear.row_start : linear.row_start + n]
        return rank_local(shell), shell, LayerPart(part, f"{part}.bias", mine), len(every)
    return shell, shell, LayerPart(part, f"{part}.bias", rows), covered


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
        layer_parts, full_n = [], 0
        for (part, rows), linear in zip(parts, linears):
            module, shell, layer_part, part_n = _int4_shell(part, rows, linear, fmt)
            shells[layer_part.prefix] = shell
            set_module(model, part, module.to(device))
            layer_parts.append(layer_part)
            full_n += part_n
        full_k = _full_inputs(linears[0])
        layers[name] = CheckpointLayer(full_k, full_n, tuple(layer_parts))
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
        int4_layers.update(expert_int4_layers(model, name, module))
    sizes = {m.group_size for m in int4_layers.values()}
    if len(sizes) != 1:
        raise ValueError(f"int4 layers use different group sizes {sorted(sizes)}")
    int4_modules = layers.keys() | experts.keys()
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] in int4_modules:
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
