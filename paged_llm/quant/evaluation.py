"""Measuring a (quantized) model: held-out perplexity, weight bytes, greedy agreement."""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_llm.layers.moe import FusedExperts
from paged_llm.quant.base import linears_by_block
from paged_llm.quant.calibration import dense_forward
from paged_llm.quant.experts import experts_weight_bytes
from paged_llm.quant.layers import QuantLinear


@torch.no_grad()
def next_token_logprobs(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 8, kv_cache_dtype: str = "auto"
) -> list[torch.Tensor]:
    """Per batch of [N, L] windows, log-probabilities of every next token: [B * (L-1), V] f32,
    attending through a KV cache of ``kv_cache_dtype``."""
    out = []
    for batch in windows.split(batch_size):
        bsz, length = batch.shape
        hidden = dense_forward(model, batch, kv_cache_dtype).view(bsz, length, -1)
        logits = model.compute_logits(hidden[:, :-1].reshape(-1, hidden.shape[-1]))  # float32
        out.append(logits.log_softmax(dim=-1))
    return out


def perplexity_of(
    logprobs: list[torch.Tensor], windows: torch.Tensor, batch_size: int = 8
) -> float:
    """exp(mean NLL of the actual next tokens) from :func:`next_token_logprobs`."""
    total, count = 0.0, 0
    for lp, batch in zip(logprobs, windows.split(batch_size)):
        targets = batch[:, 1:].reshape(-1, 1).to(lp.device)
        total -= lp.gather(1, targets).sum().item()
        count += targets.numel()
    return math.exp(total / count)


def perplexity(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 8, kv_cache_dtype: str = "auto"
) -> float:
    """exp(mean next-token NLL) of our model over [N, L] token windows (each its own sequence)."""
    return perplexity_of(
        next_token_logprobs(model, windows, batch_size, kv_cache_dtype), windows, batch_size
    )


def divergence(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> dict[str, float]:
    """How far a quantized model's predictions are from the float model's, token by token:
    mean KL(reference || candidate) in nats and the share of positions with the same argmax.

    Far more sensitive than perplexity, which can stay flat while individual predictions move.
    """
    kl, same, count = 0.0, 0, 0
    for ref, cand in zip(reference, candidate):
        kl += (ref.exp() * (ref - cand)).sum().item()
        same += (ref.argmax(-1) == cand.argmax(-1)).sum().item()
        count += ref.shape[0]
    return {"kl_divergence": kl / count, "top1_agreement": same / count}


def linear_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the block linear layers' weights as stored, and their size in float16.

    ``weight_bytes``: quantized layers count their packed weights, zeros and scales; float
    layers count at 2 bytes per weight (the fp16 baseline the issue compares against). The
    stacked weights of mixture-of-experts layers count alike.
    """
    stored, fp16 = 0, 0
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            weights = module.num_weights()
            quantized = module.gate_up_scale is not None
            stored += experts_weight_bytes(module) if quantized else 2 * weights
            fp16 += 2 * weights
        elif isinstance(module, QuantLinear):
            stored += module.weight_bytes()
            fp16 += 2 * module.in_features * module.out_features
        elif type(module) is nn.Linear and _in_block(name):
            stored += 2 * module.weight.numel()
            fp16 += 2 * module.weight.numel()
    return {"weight_bytes": stored, "fp16_weight_bytes": fp16}


def _in_block(name: str) -> bool:
    from paged_llm.quant.base import block_of

    return block_of(name) is not None


def quantizable_parameter_count(model: nn.Module) -> int:
    """Weights of the layers a method would quantize."""
    return sum(
        model.get_submodule(n).weight.numel() for ns in linears_by_block(model).values() for n in ns
    )


def token_agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Share of positions where two sets of greedy outputs pick the same token (ragged ok)."""
    same = total = 0
    for ref, cand in zip(reference, candidate):
        total += max(len(ref), len(cand))
        same += sum(a == b for a, b in zip(ref, cand))
    return same / total if total else 1.0
