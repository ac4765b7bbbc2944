"""GPTQ (Frantar et al., 2023): quantize a layer's weight one input column at a time and push
each column's rounding error onto the not-yet-quantized columns, weighted by the inverse
Hessian ``H = 2 X^T X`` of the layer's calibration inputs X.

Blocks (decoder layers) are done in order, each calibrated on the outputs of the already
quantized blocks before it. Writes the same packed int4 format as RTN and AWQ.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_llm.quant.base import Int4GroupCheck, QuantMethod, linears_by_block, set_module
from paged_llm.quant.calibration import BlockwiseCalibration
from paged_llm.quant.int4 import minmax_params, quantize_with
from paged_llm.quant.layers import Int4Linear


def gptq_quantize(
    weight: torch.Tensor,  # [N, K]
    hessian: torch.Tensor,  # [K, K], proportional to X^T X
    group_size: int,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ int4: (codes [N, K], scales [G, N], zeros [G, N]), following the reference code."""
    w = weight.detach().float().clone()
    n, k = w.shape
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs that never fire: any weight works, so zero them
    h[dead, dead] = 1
    w[:, dead] = 0
    # Dampening keeps H positive definite; its size is relative to H's average diagonal.
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, device=h.device)
    # The upper Cholesky factor of H^-1 gives, row by row, the update coefficients.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    codes = torch.zeros_like(w)
    scales = torch.zeros(k // group_size, n, device=w.device)
    zeros = torch.zeros_like(scales)
    block_size = group_size * max(1, block_size // group_size)  # groups never straddle blocks
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                # Group parameters from the weights as updated so far (errors already pushed in).
                scale, zero = minmax_params(w1[:, i : i + group_size])
                scales[col // group_size], zeros[col // group_size] = scale, zero
            q = quantize_with(w1[:, i : i + 1], scale, zero)[:, 0]
            codes[:, col] = q
            dq = (q - zero) * scale
            err = (w1[:, i] - dq) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]  # lazy batch update of the remaining columns
    return codes, scales, zeros


class GPTQ(Int4GroupCheck, QuantMethod):
    """int4 group-wise GPTQ with Hessians from calibration text."""

    name = "int4_gptq"
    needs_calibration = True

    def __init__(
        self,
        group_size: int = 128,
        damp: float = 0.01,
        num_samples: int = 64,
        seq_len: int = 256,
        block_size: int = 128,
    ) -> None:
        self.group_size = group_size
        self.damp = damp
        self.num_samples = num_samples  # calibration windows (when the caller gives none)
        self.seq_len = seq_len
        self.block_size = block_size

    @torch.no_grad()
    def quantize(self, model: nn.Module, calibration: torch.Tensor | None) -> nn.Module:
        """Quantize block by block, each from the Hessians of its inputs."""
        if calibration is None:
            raise ValueError("GPTQ needs calibration token ids [N, L]")
        self.check_model(model)
        blocks = linears_by_block(model)
        calib = BlockwiseCalibration(model, calibration, next(iter(blocks)))
        for block, names in blocks.items():
            hessians = self._hessians(calib, block, names)
            for name in names:
                lin = model.get_submodule(name)
                codes, scales, zeros = gptq_quantize(
                    lin.weight, hessians[name], self.group_size, self.damp, self.block_size
                )
                set_module(
                    model,
                    name,
                    Int4Linear.from_quantized(codes, scales, zeros, self.group_size, lin.bias),
                )
            calib.advance(block)  # the next block sees this quantized block's outputs
        return model

    @staticmethod
    def _hessians(
        calib: BlockwiseCalibration, block: str, names: list[str]
    ) -> dict[str, torch.Tensor]:
        """``X^T X`` [K, K] of each named layer's inputs over the calibration windows."""
        hessians: dict[str, torch.Tensor] = {}

        def accumulate(name: str):
            def fn(x: torch.Tensor) -> None:  # x [T, K] float32
                hessians[name] = hessians.get(name, 0) + x.t() @ x

            return fn

        calib.run(block, {n: accumulate(n) for n in names})
        return hessians
