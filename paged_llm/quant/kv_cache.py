"""Quantized KV cache: ``kv_cache_dtype="int8"`` or ``"fp8_e4m3"`` (``"fp8"``) stores each
cached K/V vector in one byte per element plus one float32 scale per (token, head).

Scales are dynamic (absmax of each vector as it is stored), so no calibration is needed and
an outlier token only coarsens its own vector. The store op quantizes, attention dequantizes;
the scale pools [num_blocks, block_size, Hkv] are indexed by the same slots as the cache.
Relative to a 16-bit cache one token takes ``(D + 4) / (2 D)`` of the bytes (0.53 at D = 64,
0.52 at D = 128), so the same memory holds about twice the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    """How the paged cache stores vectors: element dtype, and scales when quantized."""

    dtype: torch.dtype
    quantized: bool = False
    qmax: float = 0.0  # largest representable magnitude of the codes (quantized only)

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes one cached head vector occupies, its scale included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return head_dim * elem + (SCALE_DTYPE.itemsize if self.quantized else 0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H, D] float -> (codes [T, H, D] in ``dtype``, scales [T, H] float32)."""
        x = x.float()
        scale = (x.abs().amax(dim=-1) / self.qmax).clamp(min=1e-12)  # all-zero vectors stay 0
        y = (x / scale[..., None]).clamp(-self.qmax, self.qmax)
        if not self.dtype.is_floating_point:
            y = torch.round(y)
        return y.to(self.dtype), scale

    @staticmethod
    def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """codes [..., D] * scale [...] -> [..., D] in ``dtype``."""
        return (codes.float() * scale.float()[..., None]).to(dtype)


# vLLM's names; "auto" (the model dtype, unquantized) is handled by kv_cache_spec.
KV_CACHE_DTYPES: dict[str, KVCacheSpec] = {
    "int8": KVCacheSpec(torch.int8, True, 127.0),
    "fp8_e4m3": KVCacheSpec(torch.float8_e4m3fn, True, float(torch.finfo(torch.float8_e4m3fn).max)),
}
KV_CACHE_DTYPES["fp8"] = KV_CACHE_DTYPES["fp8_e4m3"]


def kv_cache_spec(name: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """The cache layout for ``kv_cache_dtype=name``; ``auto`` keeps the model dtype."""
    if name == "auto":
        return KVCacheSpec(model_dtype)
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown kv_cache_dtype '{name}'; choose one of {['auto', *KV_CACHE_DTYPES]}"
        ) from None


def spec_for_cache(cache: torch.Tensor) -> KVCacheSpec:
    """The quantized spec of a cache tensor from its dtype (for ops given scale pools)."""
    for spec in KV_CACHE_DTYPES.values():
        if spec.dtype == cache.dtype:
            return spec
    raise ValueError(f"a KV cache with scales must be int8 or float8_e4m3fn, not {cache.dtype}")
