"""What a pre-quantized (GPTQ / AWQ) checkpoint's config and int4 tensors look like: the
format parsed from ``quantization_config``, and each tensor checked against it and brought into
the GPTQ layout (:mod:`paged_llm.quant.packing`) that this project computes with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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


def expect_shape(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...], fmt: CheckpointFormat
) -> None:
    """Raise naming ``name`` when its shape is not the one the quantization config implies."""
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but the {fmt.method} quantization_config "
            f"(bits=4, group_size={fmt.group_size}) implies {shape} for this layer"
        )


@dataclass(frozen=True)
class LayerPart:
    """Where (a part of) a checkpoint's int4 layer goes in this rank's model."""

    prefix: str  # our module that takes the int4 tensors
    bias: str  # the name its bias takes
    rows: torch.Tensor | None = None  # the checkpoint layer's output rows it holds (None: all)
    cols: tuple[int, int] | None = None  # (start, size) of its inputs on a row-parallel rank


@dataclass(frozen=True)
class CheckpointLayer:
    """One int4 layer as the checkpoint stores it (full sizes), and the layers of ours that
    hold it: itself, the parts of a layer the checkpoint fuses (GPT-2's c_attn), and under
    tensor parallelism only this rank's rows or input columns of those."""

    in_features: int
    out_features: int
    parts: tuple[LayerPart, ...]


def gptq_layout(
    name: str, suffix: str, tensor: torch.Tensor, layer: CheckpointLayer, fmt: CheckpointFormat
) -> torch.Tensor:
    """One int4 tensor of ``layer``, shape-checked against the quantization config, in the
    GPTQ layout (AWQ's interleaved nibbles reordered)."""
    k, n = layer.in_features, layer.out_features
    groups = k // fmt.layer_group_size(k)
    if suffix == "scales":
        expect_shape(name, tensor, (groups, n), fmt)
    elif suffix == "g_idx":
        expect_shape(name, tensor, (k,), fmt)
        if int(tensor.min()) < 0 or int(tensor.max()) >= groups:
            raise ValueError(
                f"{name} indexes groups {int(tensor.min())}..{int(tensor.max())} but the "
                f"{fmt.method} quantization_config (group_size={fmt.group_size}) implies "
                f"{groups} groups for this layer"
            )
    elif fmt.method == "gptq":
        expect_shape(name, tensor, (k // 8, n) if suffix == "qweight" else (groups, n // 8), fmt)
    elif suffix == "qweight":  # AWQ: [K, N/8] interleaved -> GPTQ [K/8, N]
        expect_shape(name, tensor, (k, n // 8), fmt)
        tensor = pack_int4(unpack_int4(tensor, dim=1, order=AWQ_ORDER), dim=0)
    else:  # AWQ qzeros: same shape as GPTQ's, columns interleaved
        expect_shape(name, tensor, (groups, n // 8), fmt)
        tensor = pack_int4(unpack_int4(tensor, dim=1, order=AWQ_ORDER), dim=1)
    return tensor


def input_cols(
    suffix: str, tensor: torch.Tensor, cols: tuple[int, int], group: int
) -> torch.Tensor:
    """The part of a GPTQ-layout tensor for input features [start, start + size), whole groups
    (a row-parallel rank's slice)."""
    start, size = cols
    if suffix == "qweight":  # eight inputs per int32 row
        return tensor.narrow(0, start // 8, size // 8)
    if suffix == "g_idx":
        local = tensor.narrow(0, start, size) - start // group
        if int(local.min()) < 0 or int(local.max()) >= size // group:
            raise ValueError(
                "an act-order g_idx that mixes groups across tensor-parallel ranks' inputs "
                "is not supported"
            )
        return local
    return tensor.narrow(0, start // group, size // group)  # scales, qzeros: one row a group


def output_rows(suffix: str, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The part of a GPTQ-layout tensor that holds output features ``rows`` (columns here;
    g_idx, over the inputs, is every part's)."""
    if suffix == "g_idx":
        return tensor
    if suffix == "qzeros":  # eight outputs per int32: unpack, select, pack again
        return pack_int4(unpack_int4(tensor, dim=1)[:, rows], dim=1)
    return tensor[:, rows].contiguous()
