"""LLaMA's variants that differ only in which projections carry a bias and whether q and k
are RMS-normed per head: Mistral, Qwen2 and Qwen3 (llama.py's decoder reads the flags)."""

from __future__ import annotations

from typing import Any

from paged_llm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: LLaMA without any biases (and, in v0.1, a sliding window on every layer)."""

    @staticmethod
    def bias_flags(config: Any) -> tuple[bool, bool, bool]:
        """Mistral has no bias anywhere."""
        return False, False, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: LLaMA with biases on the q/k/v projections only."""

    @staticmethod
    def bias_flags(config: Any) -> tuple[bool, bool, bool]:
        """Qwen2 biases q/k/v but not o_proj or the MLP."""
        return True, False, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: LLaMA with per-head RMSNorm on q and k (biases as LLaMA: ``attention_bias``)."""

    qk_norm = True
