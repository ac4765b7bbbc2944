"""Mixture-of-experts decoders: LLaMA-family blocks whose MLP is a routed set of experts
(``paged_llm/layers/moe.py``). Only the feed-forward block and the checkpoint's expert names
differ from ``llama.py``:

* Mixtral: every layer sparse, top-k weights renormalised, checkpoint names
  ``block_sparse_moe.experts.<e>.w1/w3/w2`` (gate / up / down);
* Qwen2-MoE: q/k/v biases, top-k weights renormalised only with ``norm_topk_prob``, a shared
  expert gated by a sigmoid, dense layers where ``mlp_only_layers`` / ``decoder_sparse_step``
  say so;
* Qwen3-MoE: Qwen3's q/k norms, Qwen2-MoE's routing without the shared expert.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paged_llm.layers.moe import SparseMoeBlock, stack_expert_weights
from paged_llm.models.llama import LlamaForCausalLM, LlamaMLP
from paged_llm.models.llama_variants import MistralForCausalLM


class MoECausalLM(LlamaForCausalLM):
    """Shared loading of the MoE variants: per-expert checkpoint tensors are stacked into each
    layer's fused expert weights before they are copied in."""

    @staticmethod
    def num_experts(config: Any) -> int:
        """Experts per sparse layer (the config field's name differs per architecture)."""
        return config.num_experts

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str | None, torch.Tensor]]:
        """Renamed as every model's, with each layer's per-expert tensors stacked."""
        return stack_expert_weights(
            super().checkpoint_tensors(weights), self.num_experts(self.config)
        )


class MixtralForCausalLM(MoECausalLM):
    """Mixtral: Mistral with a top-k mixture of SwiGLU experts in every layer."""

    _CHECKPOINT_NAMES = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.weight", ".gate_proj.weight"),
        (".w3.weight", ".up_proj.weight"),
        (".w2.weight", ".down_proj.weight"),
    )

    bias_flags = staticmethod(MistralForCausalLM.bias_flags)  # no bias anywhere

    @staticmethod
    def num_experts(config: Any) -> int:
        """Mixtral calls it ``num_local_experts``."""
        return config.num_local_experts

    @classmethod
    def make_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        """Every Mixtral layer is sparse; the kept top-k weights are renormalised."""
        return SparseMoeBlock(
            config, config.num_local_experts, config.intermediate_size, renormalize=True
        )

    def export_name(self, name: str) -> str:
        """Ours back to Mixtral's checkpoint names (every Mixtral MLP is sparse)."""
        if ".mlp." in name:
            for old, new in self._CHECKPOINT_NAMES:
                name = name.replace(new, old)
        return name

    def checkpoint_name(self, name: str) -> str | None:
        """Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2`` -> ``mlp.experts.<e>.gate/up/
        down_proj`` (transformers' in-memory names)."""
        name = super().checkpoint_name(name)
        if name is not None and ".block_sparse_moe." in name:
            for old, new in self._CHECKPOINT_NAMES:
                name = name.replace(old, new)
        return name


def qwen_moe_layer_is_sparse(config: Any, layer_idx: int) -> bool:
    """Qwen2/3-MoE's rule: sparse unless listed in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th layer."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0


class QwenMoeForCausalLM(MoECausalLM):
    """What Qwen2-MoE and Qwen3-MoE share: dense layers by ``mlp_only_layers`` /
    ``decoder_sparse_step``, top-k weights renormalised only with ``norm_topk_prob``."""

    has_shared_expert = False

    @classmethod
    def make_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        """A sparse block (with the shared expert where the variant has one), or a dense MLP
        (``intermediate_size``)."""
        if not qwen_moe_layer_is_sparse(config, layer_idx):
            return LlamaMLP(config, bias=False)
        shared = (
            LlamaMLP(config, False, config.shared_expert_intermediate_size)
            if cls.has_shared_expert
            else None
        )
        return SparseMoeBlock(
            config,
            config.num_experts,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            shared_expert=shared,
        )


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen2-MoE: Qwen2 attention; sparse layers add a sigmoid-gated shared expert."""

    has_shared_expert = True

    @staticmethod
    def bias_flags(config: Any) -> tuple[bool, bool, bool]:
        """q/k/v biased when ``qkv_bias`` (the default), as in Qwen2; o_proj and MLPs never."""
        return bool(getattr(config, "qkv_bias", True)), False, False


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen3-MoE: Qwen3 attention (q/k norms); sparse layers have no shared expert."""

    qk_norm = True
