"""Running our models over whole token windows outside the engine, for calibration (GPTQ/AWQ)
and perplexity: every window is one prefill sequence with its own block in a scratch cache."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from paged_llm.attention.metadata import build_attention_metadata
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.layers.attention import ForwardContext
from paged_llm.models.loader import kv_cache_shape_info
from paged_llm.quant.base import model_device
from paged_llm.quant.kv_cache import SCALE_DTYPE, kv_cache_spec
from paged_llm.runner.kv_cache import allocate_kv_caches, allocate_kv_scales


@torch.no_grad()
def dense_forward(
    model: nn.Module, input_ids: torch.Tensor, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Final hidden states of [B, L] windows, each a fresh sequence: [B * L, H]."""
    bsz, length = input_ids.shape
    device = model_device(model)
    spec = kv_cache_spec(kv_cache_dtype, model.get_input_embeddings().weight.dtype)
    layers, kv_heads, head_dim = kv_cache_shape_info(model.config)
    # One block of `length` slots per window.
    caches = allocate_kv_caches(layers, bsz, length, kv_heads, head_dim, spec.dtype, device)
    scales = None
    if spec.quantized:
        scales = allocate_kv_scales(layers, bsz, length, kv_heads, SCALE_DTYPE, device)
    meta = build_attention_metadata(
        [length] * bsz, [length] * bsz, [[b] for b in range(bsz)], length, device
    )
    ctx = ForwardContext(meta, TorchAttentionBackend(), caches, scales)
    positions = torch.arange(length, device=device).repeat(bsz)
    return model(input_ids.reshape(-1).to(device), positions, ctx)


class _StopForward(Exception):
    """Raised by a hook to end a calibration pass once the layers of interest have run."""


@torch.no_grad()
def run_with_input_hooks(
    model: nn.Module,
    calibration: torch.Tensor,  # [N, L] token ids
    hooks: dict[str, Callable[[torch.Tensor], None]],
    stop_after: str | None = None,
    batch_size: int = 8,
) -> None:
    """Run the calibration windows, calling ``hooks[name](x [T, K] float32)`` with the input of
    each named module; the pass ends early right after ``stop_after`` has seen its input."""
    handles = []

    def make(name: str, fn: Callable[[torch.Tensor], None]):
        def pre_hook(_module: nn.Module, args: tuple) -> None:
            x = args[0]
            fn(x.reshape(-1, x.shape[-1]).float())
            if name == stop_after:
                raise _StopForward

        return pre_hook

    for name, fn in hooks.items():
        handles.append(model.get_submodule(name).register_forward_pre_hook(make(name, fn)))
    try:
        for batch in calibration.split(batch_size):
            with contextlib.suppress(_StopForward):  # the pass ended where it was told to
                dense_forward(model, batch)
    finally:
        for h in handles:
            h.remove()


def calibration_windows(
    tokens: np.ndarray | torch.Tensor, num_samples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """``num_samples`` random windows of ``seq_len`` tokens from a token stream: [N, L] int64."""
    tokens = torch.as_tensor(np.asarray(tokens).astype(np.int64))
    if tokens.numel() <= seq_len:
        raise ValueError(f"calibration text has {tokens.numel()} tokens; need more than {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len, (num_samples,), generator=gen)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def default_calibration(
    tokenizer, vocab_size: int, num_samples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """Calibration windows when the caller gives none: the training split of the stdlib corpus
    tokenized with the model's tokenizer, or random token ids for a model without one."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (num_samples, seq_len), generator=gen)
    from paged_llm.recipes.corpus import CorpusSpec, read_texts, split_files

    train_files, _ = split_files(CorpusSpec())
    ids: list[int] = []
    for text in read_texts(train_files):  # hashed order: a mix of modules, deterministic
        ids.extend(tokenizer(text)["input_ids"])
        if len(ids) > 4 * num_samples * seq_len:
            break
    return calibration_windows(np.asarray(ids), num_samples, seq_len, seed)
