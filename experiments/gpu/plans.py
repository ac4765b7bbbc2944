"""The GPU check's modes: sizes and time caps of each section (full, quick, CPU smoke)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

EXTRA_SECTIONS = ("kernel_sweep", "quant_decode", "sleep_offload", "spec_decode")
SECTIONS = (
    "kernels", "parity", "kernel_sweep", "decode_bandwidth", "fig18a", "end_to_end",
    "quant_decode", "sleep_offload", "spec_decode",
)  # fmt: skip

TOL = {  # the tolerances of tests/test_kernels.py
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# ---- plans --------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Sizes and time budgets of one mode."""

    mode: str
    budget_s: float  # for all sections together (imports and start-up come on top)
    section_s: dict[str, float]  # each section's own cap
    copy_mib: int
    matmul_n: int
    kernel_dtypes: list[str]
    kernel_heads: tuple[int, int, int]  # (Hq, Hkv, D) of the correctness checks
    kernel_seq_lens: list[int]
    attn_heads: tuple[int, int, int]  # (Hq, Hkv, D) of the timing sections (LLaMA-7B: 32/32/128)
    decode_batches: list[int]
    decode_contexts: list[int]
    block_sizes: list[int]
    fig18_batches: list[int]
    fig18_contexts: list[int]
    timing_reps: int
    model: str  # a preset name, or "tiny-llama" (saved to a temp dir)
    dtype: str
    num_requests: int
    max_total: int  # prompt + output tokens per request (the paper's ShareGPT filter: 2048)
    max_num_seqs: int
    hf_batch_size: int  # static generate
    hf_subset: int  # requests for generate_batch (and ours on the same requests)
    warmup_requests: int = 8


FULL = Plan(
    mode="full",
    # Sections stop at their deadlines, but model builds and shutdowns can run ~1 min past
    # them; with ~20 s of imports this stays under 8 minutes. --extras adds the two sweep
    # sections and their caps (about 3 minutes more).
    budget_s=400,
    section_s=dict(
        bandwidth=10,
        kernels=60,
        parity=40,
        kernel_sweep=75,
        decode_bandwidth=40,
        fig18a=20,
        end_to_end=220,
        quant_decode=90,
        sleep_offload=90,
        spec_decode=150,
    ),
    copy_mib=2048,
    matmul_n=8192,
    kernel_dtypes=["fp16", "bf16", "fp32"],
    kernel_heads=(32, 8, 128),
    kernel_seq_lens=[1, 17, 300, 1100],
    attn_heads=(32, 32, 128),
    decode_batches=[1, 32, 128],
    decode_contexts=[512, 1024, 2048, 4096, 8192],
    block_sizes=[16, 32],
    fig18_batches=[8, 32],
    fig18_contexts=[64, 128, 256, 512, 1024, 2048],
    timing_reps=5,
    model="llama-7b",
    dtype="bfloat16",
    num_requests=1000,
    max_total=2048,
    max_num_seqs=256,
    hf_batch_size=32,
    hf_subset=200,
)
PLANS = {
    "full": FULL,
    "quick": replace(
        FULL,
        mode="quick",
        budget_s=200,
        section_s=dict(
            bandwidth=10,
            kernels=35,
            parity=30,
            kernel_sweep=30,
            decode_bandwidth=25,
            fig18a=15,
            end_to_end=100,
            quant_decode=60,
            sleep_offload=75,
            spec_decode=60,
        ),
        copy_mib=1024,
        kernel_seq_lens=[1, 17, 300],
        decode_contexts=[512, 2048, 8192],
        fig18_contexts=[128, 512, 2048],
        timing_reps=3,
        num_requests=200,
        hf_subset=64,
    ),
    # CPU, Triton interpreter, a tiny Llama saved with transformers: only checks the plumbing.
    "smoke": replace(
        FULL,
        mode="smoke",
        budget_s=70,
        section_s=dict(
            bandwidth=3,
            kernels=15,
            parity=20,
            kernel_sweep=8,
            decode_bandwidth=6,
            fig18a=4,
            end_to_end=20,
            quant_decode=15,
            sleep_offload=20,
            spec_decode=30,
        ),
        copy_mib=8,
        matmul_n=128,
        kernel_dtypes=["fp32"],
        kernel_heads=(4, 2, 16),
        kernel_seq_lens=[1, 9, 21],
        attn_heads=(4, 2, 16),
        decode_batches=[1, 2],
        decode_contexts=[32, 64],
        fig18_batches=[2],
        fig18_contexts=[32],
        timing_reps=2,
        model="tiny-llama",
        dtype="float32",
        num_requests=6,
        max_total=40,
        max_num_seqs=8,
        hf_batch_size=3,
        hf_subset=4,
        warmup_requests=2,
    ),
}
