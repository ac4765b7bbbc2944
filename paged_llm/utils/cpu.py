"""Facts about the host CPU that pick code paths."""

from __future__ import annotations

import torch


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 / AMX), as oneDNN reports it."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
