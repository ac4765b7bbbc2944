"""Running our models over whole token windows outside the engine, for calibration (GPTQ/AWQ)
and perplexity: every window is one prefill sequence with its own block in a scratch cache."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

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
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(
        [length] * bsz, [length] * bsz, [[b] for b in range(bsz)], length, device
    )
    ctx = ForwardContext(meta, backend, caches, scales)
    positions = torch.arange(length, device=device).repeat(bsz)
    return model(input_ids.reshape(-1).to(device), positions, ctx)


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the first block's inputs are captured."""


class BlockwiseCalibration:
    """Calibration activations block by block, as GPTQ and AWQ compute them.

    The windows run through the model once, up to the first block, whose call arguments
    (hidden states [B * L, H] and whatever else the block takes) are kept per batch. Then
    :meth:`run` passes them through one block while hooks see the inputs of its layers, and
    :meth:`advance` replaces the hidden states by that block's output, computed after it was
    quantized, so every block is calibrated on what the quantized blocks before it produce.
    Blocks must return their hidden states as a tensor (as this project's decoder layers do).
    """

    def __init__(
        self, model: nn.Module, calibration: torch.Tensor, first_block: str, batch_size: int = 8
    ) -> None:
        self.model = model
        self.batches: list[tuple[tuple, dict]] = []  # (args, kwargs) of the block's forward

        def capture(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.batches.append((args, kwargs))
            raise _StopForward

        handle = model.get_submodule(first_block).register_forward_pre_hook(
            capture, with_kwargs=True
        )
        try:
            for batch in calibration.split(batch_size):
                with contextlib.suppress(_StopForward):  # stopped at the first block
                    dense_forward(model, batch)
        finally:
            handle.remove()

    @torch.no_grad()
    def run(self, block: str, hooks: dict[str, Callable[[torch.Tensor], None]]) -> None:
        """Run ``block`` over every batch, calling ``hooks[name](x [T, K] float32)`` with the
        input of each named submodule (full dotted names)."""
        handles = []
        for name, fn in hooks.items():

            def pre_hook(_module: nn.Module, args: tuple, fn=fn) -> None:
                fn(args[0].reshape(-1, args[0].shape[-1]).float())

            handles.append(self.model.get_submodule(name).register_forward_pre_hook(pre_hook))
        try:
            module = self.model.get_submodule(block)
            for args, kwargs in self.batches:
                module(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def advance(self, block: str) -> None:
        """Replace each batch's hidden states by ``block``'s output (the next block's input)."""
        module = self.model.get_submodule(block)
        self.batches = [
            ((module(*args, **kwargs), *args[1:]), kwargs) for args, kwargs in self.batches
        ]


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
        ids.extend(tokenizer(text, verbose=False)["input_ids"])  # no "too long" warning: cut below
        if len(ids) > 4 * num_samples * seq_len:
            break
    return calibration_windows(np.asarray(ids), num_samples, seq_len, seed)
