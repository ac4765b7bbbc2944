"""Per-architecture launch configurations of the Triton kernels, as data.

Each kernel takes its tile sizes, warps and pipeline stages from :func:`kernel_config`, which
picks the row for the GPU's architecture (``sm90`` Hopper, ``sm80`` Ampere) or ``default``
(other GPUs, and the CPU interpreter, where only correctness matters). Every argument can
still be overridden per call, which is how ``experiments/gpu/sweeps.py`` sweeps candidates.

Where a row came from is written beside it: a measurement (file and date) or "untuned". To
tune a new architecture, run the sweep of ``experiments/gpu/sweeps.py`` on it and add a row;
``experiments/kernel_compile_report.py`` checks registers and spills for any target on a CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel: tiles, warps per program, software-pipeline stages."""

    block_n: int  # attention: context positions per tile; matmul: output columns per program
    block_k: int = 0  # matmul: reduction tile (0 where the kernel has none)
    block_m: int = 0  # prefill attention: query rows per program (0 where the kernel has none)
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 0  # matmul: K partitions; 0 picks one from the GPU size
    gemv_rows: int = 0  # matmul: up to this many rows, the *_gemv row's multiply-and-sum path

    def with_overrides(self, **overrides: int | None) -> KernelConfig:
        """This config with every non-None override applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


# kernel -> architecture -> config.
TUNED: dict[str, dict[str, KernelConfig]] = {
    "paged_decode": {
        "default": KernelConfig(block_n=64, num_warps=4, num_stages=2),  # untuned
        "sm80": KernelConfig(block_n=64, num_warps=4, num_stages=2),  # untuned (no A100 run)
        # H200, paper_repro/gpu_results/2026-11-30-h200-run1.json (kernel_sweep): best of 6
        # configs at batch 32/128 x context 2048/8192, 1.00-1.06x the copy bandwidth.
        "sm90": KernelConfig(block_n=64, num_warps=4, num_stages=3),
    },
    # block_m counts rows = query tokens x the query heads of one KV head (GQA packing, see
    # ops/paged_attention/triton_prefill.py). The GPU rows are FlashAttention-2-style first
    # guesses; the default row keeps tiles small for the CPU interpreter (and other GPUs).
    "paged_prefill": {
        "default": KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=2),  # untuned
        "sm80": KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),  # untuned
        # H100 run 14 (paper_repro/gpu_results/2026-12-05-h100-run14-kernel-sweep.json): the
        # best of 12 configs over 4 x 512-token prompts (58.5 us, 147 TFLOP/s) and a 512-token
        # chunk beside 64 decodes (427 us); geomean within 0.04% of each workload's best.
        "sm90": KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    },
    # sm90 rows: H200 run 3 (paper_repro/gpu_results/2026-11-30-h200-run3.json, kernel_sweep,
    # timed inside CUDA graphs): the best tl.dot config of 5 and GEMV config of 7 on LLaMA-7B's
    # three linear shapes, and the GEMV switch point (gemv_rows: the largest of 1 / 4 rows at
    # which GEMV won on every shape). int8: tl.dot won at 1 row too (9.4 vs 12.4 us at 4096^2);
    # int4: GEMV won at 1 row (15.8 vs 20.1 us), lost at 4. With these rows batch-1 decode ran
    # at 1.17x (int8), 0.72x (int4) and 1.01x (fp8) of bf16. Run 2 (eagerly timed, no GEMV)
    # had block_n 16, split-K auto: 0.89x / 0.65x / 0.61x. sm80 rows copy sm90's switch points
    # (no A100 run); the default row (other GPUs, the CPU interpreter) switches at 4 rows so
    # the interpreter tests run both paths. Both int4 kernels were rewritten after run 3
    # (about 40% fewer instructions per weight by the compile report); run 5
    # (paper_repro/gpu_results/2026-12-04-h200-run5.json) swept them again and kept these rows
    # (int4 GEMV at 1 row: 9.8 us against bf16's 9.9 us at 4096^2), and batch-1 decode ran at
    # 1.13x (int8), 1.16x (int4) and 0.99x (fp8) of bf16. Its int8 GEMV best was block_n 128
    # (unused on sm90, where gemv_rows is 0 for int8).
    "int8_matmul": {
        "default": KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=2, gemv_rows=4),
        "sm80": KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=3),  # untuned
        "sm90": KernelConfig(block_n=64, block_k=128, num_warps=4, num_stages=3),
    },
    "int4_matmul": {
        "default": KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=2, gemv_rows=4),
        "sm80": KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=3, gemv_rows=1),
        "sm90": KernelConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, gemv_rows=1),
    },
    # The multiply-and-sum (GEMV) path of the two kernels; sm90 from the same sweep.
    "int8_gemv": {
        "default": KernelConfig(block_n=32, block_k=128, num_warps=4, num_stages=2),
        "sm80": KernelConfig(block_n=16, block_k=256, num_warps=4, num_stages=3),  # untuned
        "sm90": KernelConfig(block_n=128, block_k=128, num_warps=4, num_stages=3),
    },
    "int4_gemv": {
        "default": KernelConfig(block_n=32, block_k=128, num_warps=4, num_stages=2),
        "sm80": KernelConfig(block_n=32, block_k=128, num_warps=4, num_stages=3),  # untuned
        "sm90": KernelConfig(block_n=64, block_k=128, num_warps=4, num_stages=3),
    },
    # Both grouped GEMMs of ops/moe/triton.py; the row tile (block_m) follows the tokens per
    # expert there, not the architecture.
    "fused_moe": {
        "default": KernelConfig(block_n=64, block_k=32, num_warps=4, num_stages=2),  # untuned
        "sm80": KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=3),  # untuned
        "sm90": KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=3),  # untuned
    },
}

# fp32 operands (a debug dtype) need far more registers per tile: smaller attention tiles.
FP32_ATTENTION_BLOCK = 32


def arch_of(device: torch.device) -> str:
    """``sm90``, ``sm80`` or ``default`` for a device (the CPU is ``default``)."""
    if device.type != "cuda":
        return "default"
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (split-K choices are made from it)."""
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache  # asked on every decode step
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache  # asked on every kernel launch
def _cuda_arch(index: int) -> str:
    major, _ = torch.cuda.get_device_capability(index)
    return {9: "sm90", 8: "sm80"}.get(major, "default")


def kernel_config(kernel: str, device: torch.device) -> KernelConfig:
    """The tuned launch config of ``kernel`` on ``device``'s architecture."""
    rows = TUNED[kernel]
    return rows.get(arch_of(device), rows["default"])
