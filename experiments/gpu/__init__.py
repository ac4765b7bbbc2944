"""The one prepared GPU check (issue 9): everything a short GPU loan should measure, in one run
that writes one JSON file. Each section is time-boxed; a section that cannot fit in what is
left of the budget is skipped with the reason recorded, and the JSON is rewritten after every
section, so a run cut short still leaves its results.

    python -m experiments.gpu --out outputs/gpu_check            # full: < 8 min, one H200
    python -m experiments.gpu --quick --out outputs/gpu_check    # ~4 min
    ... --extras    # + kernel_sweep and quant_decode (sweeps.py), ~2.5 min more
    python -m experiments.gpu --smoke --out /tmp/gpu_check       # CPU, tiny, interpreter
    ... --trace paged_llm/workloads/data/sharegpt_opt_lengths.csv            # ShareGPT lengths

Sections, in order (later ones use the bandwidth measured first):

1. ``bandwidth``: device-to-device copy bandwidth ((read + write) bytes / s) and bf16 matmul rate.
2. ``kernels``: every Triton kernel (KV store incl. int8/fp8, paged decode with and without
   split-K and with an int8 cache, paged prefill, block copy, int8/int4 matmul, multi-LoRA
   shrink/expand) against its
   torch reference on the device, in fp16, bf16 and fp32.
   ``parity`` (parity.py): greedy tokens of this engine vs transformers on the
   same device for Llama/Mistral/Qwen2/OPT in fp32 (must be identical), bf16 and fp16.
   ``kernel_sweep`` (--extras; sweeps.py): launch configs of the decode and
   varlen prefill attention and quantized matmul kernels on LLaMA-7B shapes, the data behind
   paged_llm/ops/tuning.py.
3. ``decode_bandwidth``: the paged decode kernel's achieved bandwidth (K/V bytes read / time)
   at batch 1/32/128, contexts 512-8192, block sizes 16/32, as a fraction of the copy bandwidth.
4. ``fig18a``: the paper's Fig. 18a, paged vs contiguous attention kernel latency: the Triton
   paged kernel (shuffled blocks), the same kernel over in-order blocks, and torch SDPA over a
   contiguous [B, H, L, D] cache.
5. ``end_to_end``: offline throughput of this engine on a LLaMA-7B-shaped model with random
   bf16 weights on ShareGPT-shaped requests, against transformers' static-batch ``generate``
   and continuous-batching ``generate_batch`` on the same GPU, and against the bandwidth bound
   B x BW / (weight bytes + B x context x KV bytes per token).
6. ``quant_decode`` (--extras; sweeps.py): decode tokens/s of the same model
   shape in bf16, int8, int4 and fp8 at batch 1 and 32.
7. ``sleep_offload`` (--extras; memory_features.py): sleep mode at levels 1 and 2
   with CUDA graphs (memory freed, seconds, same outputs after waking), the prefix cache's
   CPU tier (an evicted prompt copied back from pinned memory, same output) and KV transfer
   between a producer and a consumer engine (blocks moved, ms per block, same tokens).
8. ``spec_decode`` (--extras; spec_decode.py): the built-in trained target with
   its draft model, EAGLE head and n-grams: greedy outputs against the target alone (float32)
   and tokens/s at k = 2 and 4, batch 1 and 16. Its models are exported before the loan:
   ``python -m experiments.gpu.spec_decode --export .gpu_inputs/spec_models``.

Targets (docs/gpu.md) are evaluated into ``targets`` in the JSON; nothing here is estimated.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv[1:]:  # before triton is imported: kernels run in its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
