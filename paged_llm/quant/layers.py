"""Quantized replacements for ``nn.Linear``: same ``forward(x [.., K]) -> [.., N]``, weights
stored quantized. Their tensors are ``nn.Parameter(requires_grad=False)`` so that checkpoint
loading (which fills parameters by name) reads pre-quantized checkpoints unchanged.

Every layer offers ``dequantize()`` -> the float weight [N, K] it computes with, and
``weight_bytes()`` -> the bytes its weight occupies (bias excluded).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.ops.quant_matmul import fp8_decode_linear, int4_linear, int8_linear
from paged_llm.ops.quant_matmul.reference import dequantize_int4, dequantize_per_channel
from paged_llm.quant.packing import pack_int4

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def fp8_per_channel(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (float8_e4m3fn [..., N, K], float32 scales [..., N]): each output
    row scaled so its absmax maps to the largest e4m3 value (448), then cast."""
    w = weights.detach().float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[..., None]).to(FP8_DTYPE), scale


def int8_per_channel(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (int8 [..., N, K], float32 scales [..., N]): symmetric round to
    nearest with one absmax scale per output row (of a linear layer, or of each expert)."""
    w = weights.detach().float()
    scale = (w.abs().amax(dim=-1) / 127).clamp(min=1e-12)  # an all-zero row keeps scale > 0
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _bias_param(bias: torch.Tensor | None) -> nn.Parameter | None:
    return None if bias is None else _frozen(bias.detach().clone())


class QuantLinear(nn.Module):
    """Shared plumbing: shapes, bias, flattening leading dimensions, byte accounting."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = _bias_param(bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        """The quantized product, without bias."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        """The weight this layer effectively multiplies by."""
        raise NotImplementedError

    def weight_tensors(self) -> list[torch.Tensor]:
        """Tensors that make up the stored weight (for byte accounting)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of the stored weight (bias excluded)."""
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        """Quantized ``x @ W.T + b``."""
        y = self.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantLinear):
    """int8 weight-only, symmetric, one scale per output channel: W = w_int8 * scale[:, None]."""

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.weight = _frozen(weight.to(torch.int8))  # [N, K]
        self.weight_scale = _frozen(scale.to(torch.float32))  # [N]

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        """Round-to-nearest int8 of a float linear layer (absmax per row)."""
        q, scale = int8_per_channel(linear.weight)
        return cls(q, scale, linear.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (w * s).T`` (Triton on CUDA for decode rows)."""
        return int8_linear(x, self.weight, self.weight_scale)

    def dequantize(self) -> torch.Tensor:
        """``w * s`` per row: [N, K] float32."""
        return dequantize_per_channel(self.weight, self.weight_scale, torch.float32)

    def weight_tensors(self) -> list[torch.Tensor]:
        """int8 weight and its scales."""
        return [self.weight, self.weight_scale]


class Int4Linear(QuantLinear):
    """4-bit asymmetric group-wise weight in the GPTQ checkpoint layout (see quant/packing.py).

    ``zero_offset`` is what the stored zeros lack: 1 for the common GPTQ format (zeros stored
    minus one, which is what this project writes), 0 for AWQ or ``gptq_v2`` checkpoints.
    """

    def __init__(
        self,
        qweight: torch.Tensor,  # [K/8, N] int32
        qzeros: torch.Tensor,  # [G, N/8] int32
        scales: torch.Tensor,  # [G, N] float16
        g_idx: torch.Tensor,  # [K] int32
        group_size: int,
        bias: torch.Tensor | None = None,
        zero_offset: int = 1,
    ) -> None:
        in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
        super().__init__(in_features, out_features, bias)
        if scales.shape != (in_features // group_size, out_features):
            raise ValueError(
                f"scales {tuple(scales.shape)} do not match {in_features} inputs in groups of "
                f"{group_size} x {out_features} outputs"
            )
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.qweight = _frozen(qweight.to(torch.int32))
        self.qzeros = _frozen(qzeros.to(torch.int32))
        self.scales = _frozen(scales.to(torch.float16))
        self.g_idx = _frozen(g_idx.to(torch.int32))
        self.plain_groups = self._plain_groups()

    def _plain_groups(self) -> bool:
        """Whether g_idx is the plain ``k // group_size`` (then the Triton kernel applies)."""
        expected = torch.arange(self.in_features, device=self.g_idx.device) // self.group_size
        return bool(torch.equal(self.g_idx.long(), expected))

    @classmethod
    def shell(
        cls, in_features: int, out_features: int, group_size: int, bias: bool, zero_offset: int
    ) -> Int4Linear:
        """An empty layer of the right shapes, to be filled from a checkpoint."""
        check_int4_shape(in_features, out_features, group_size)
        groups = in_features // group_size
        layer = cls(
            torch.zeros(in_features // 8, out_features, dtype=torch.int32),
            torch.zeros(groups, out_features // 8, dtype=torch.int32),
            torch.zeros(groups, out_features, dtype=torch.float16),
            torch.arange(in_features, dtype=torch.int32) // group_size,
            group_size,
            torch.zeros(out_features) if bias else None,
            zero_offset,
        )
        return layer

    @classmethod
    def from_quantized(
        cls,
        q: torch.Tensor,  # [N, K] integer values 0..15
        scales: torch.Tensor,  # [G, N]
        zeros: torch.Tensor,  # [G, N] integer zero points 1..15
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Pack integer weights and zero points into the GPTQ layout (zeros stored minus one)."""
        n, k = q.shape
        check_int4_shape(k, n, group_size)
        if int(zeros.min()) < 1:
            raise ValueError("GPTQ-format zero points must be >= 1 (they are stored minus one)")
        return cls(
            pack_int4(q.t(), dim=0),
            pack_int4(zeros - 1, dim=1),
            scales,
            torch.arange(k, dtype=torch.int32, device=q.device) // group_size,
            group_size,
            bias,
            zero_offset=1,
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dequant(W).T`` (Triton on CUDA for decode rows)."""
        return int4_linear(
            x, self.qweight, self.qzeros, self.scales, self.g_idx,
            self.group_size, self.zero_offset, self.plain_groups,
        )  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """``(q - z) * s``: [N, K] float32."""
        return dequantize_int4(
            self.qweight, self.qzeros, self.scales, self.g_idx, self.zero_offset, torch.float32
        )

    def weight_tensors(self) -> list[torch.Tensor]:
        """Packed weight, packed zeros and scales (g_idx is bookkeeping, not weight)."""
        return [self.qweight, self.qzeros, self.scales]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class Fp8Linear(QuantLinear):
    """FP8 (e4m3) weight with one float32 scale per output channel: W = w_fp8 * scale[:, None].

    On GPUs with FP8 tensor cores (compute capability >= 8.9), decode-sized inputs take a
    weight-only Triton kernel (the activations stay in their dtype: quantizing them would cost
    more launches than the matmul at a few rows), and larger ones are quantized per row on the
    fly and multiplied with ``torch._scaled_mm``; elsewhere (the CPU) the weight is dequantized
    and multiplied in the activation dtype: the documented emulated path.
    """

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.weight = _frozen(weight.to(FP8_DTYPE))  # [N, K]
        self.weight_scale = _frozen(scale.to(torch.float32))  # [N]

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Fp8Linear:
        """Scale each row so its absmax maps to the largest e4m3 value, then cast."""
        return cls(*fp8_per_channel(linear.weight), linear.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Weight-only kernel (decode) or scaled FP8 matmul on capable GPUs, dequantize + matmul
        otherwise."""
        if x.is_cuda and fp8_matmul_supported(x.device):
            y = fp8_decode_linear(x, self.weight, self.weight_scale)
            if y is not None:
                return y
            if self._scaled_mm_shapes_ok():
                return self._scaled_mm(x)
        w = self.weight.to(x.dtype)
        return torch.nn.functional.linear(x, w) * self.weight_scale.to(x.dtype)

    def _scaled_mm_shapes_ok(self) -> bool:
        # torch._scaled_mm needs both matrix dimensions of the weight to be multiples of 16.
        return self.in_features % 16 == 0 and self.out_features % 16 == 0

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise scaled FP8 GEMM: x is quantized per row, W per output channel."""
        x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [M, 1]
        x_fp8 = (x.float() / x_scale).to(FP8_DTYPE)
        y = torch._scaled_mm(
            x_fp8,
            self.weight.t(),  # [K, N] column-major, as _scaled_mm requires
            scale_a=x_scale,
            scale_b=self.weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,  # row-wise scaling is implemented for bf16 output
        )
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """``w * s`` per row: [N, K] float32."""
        return dequantize_per_channel(self.weight, self.weight_scale, torch.float32)

    def weight_tensors(self) -> list[torch.Tensor]:
        """fp8 weight and its scales."""
        return [self.weight, self.weight_scale]


def fp8_matmul_supported(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores (CUDA compute capability >= 8.9)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_int4_shape(in_features: int, out_features: int, group_size: int) -> None:
    """Raise a clear error when a layer cannot be stored as int4 with ``group_size``."""
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"int4 group_size must be a positive multiple of 8, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"int4 group_size {group_size} does not divide the layer's {in_features} input "
            f"features; choose a group size that divides it (e.g. 32, 64 or 128)"
        )
    if out_features % 8:
        raise ValueError(
            f"int4 packs eight output channels per int32; {out_features} is not a multiple of 8"
        )


def check_int4_layers(model: nn.Module, names: list[str], group_size: int, method: str) -> None:
    """Refuse, before any work, a model with a layer the int4 group size does not divide."""
    for name in names:
        lin = model.get_submodule(name)
        try:
            check_int4_shape(lin.in_features, lin.out_features, group_size)
        except ValueError as err:
            raise ValueError(f"{method}: layer '{name}': {err}") from None
