"""Measuring the activation memory of the largest step, to size the KV pool on CUDA."""

from __future__ import annotations

import torch

from paged_llm.layers.attention import ForwardContext
from paged_llm.runner.kv_cache import allocate_kv_caches


@torch.inference_mode()
def peak_forward_bytes(runner, scheduler_config, max_model_len: int) -> int:
    """Peak extra bytes of one forward pass over the largest batch the scheduler can build.

    The pass uses a throw-away KV cache just big enough for it, so the measurement covers
    activations and logits, not the cache that is sized from what is left afterwards.
    """
    num_tokens = min(scheduler_config.max_num_batched_tokens or max_model_len, max_model_len)
    bs = runner.block_size
    num_blocks = -(-num_tokens // bs)
    caches = allocate_kv_caches(
        runner.num_layers, num_blocks, bs, runner.num_kv_heads, runner.head_dim,
        runner.dtype, runner.device,
    )  # fmt: skip
    meta = runner.backend.build_metadata(
        [num_tokens], [num_tokens], [list(range(num_blocks))], bs, runner.device
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=runner.device)
    pos = torch.arange(num_tokens, device=runner.device)
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    hidden = runner.model(ids, pos, ForwardContext(meta, runner.backend, caches))
    runner.model.compute_logits(hidden[-scheduler_config.max_num_seqs :])
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before
    del caches, hidden
    torch.cuda.empty_cache()
    return int(peak)
