"""HF ``architectures`` names (from config.json) -> our model classes."""

from __future__ import annotations

from typing import Any

from torch import nn

from paged_llm.utils.registry import import_target

# Import paths, not classes, so looking up one architecture does not import every model file.
MODEL_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "paged_llm.models.llama.LlamaForCausalLM",
    "MistralForCausalLM": "paged_llm.models.llama.MistralForCausalLM",
    "Qwen2ForCausalLM": "paged_llm.models.llama.Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "paged_llm.models.llama.Qwen3ForCausalLM",
    "MixtralForCausalLM": "paged_llm.models.moe.MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "paged_llm.models.moe.Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "paged_llm.models.moe.Qwen3MoeForCausalLM",
    "OPTForCausalLM": "paged_llm.models.opt.OPTForCausalLM",
    "GPT2LMHeadModel": "paged_llm.models.gpt2.GPT2LMHeadModel",
    "GPTNeoXForCausalLM": "paged_llm.models.gpt_neox.GPTNeoXForCausalLM",
}
# Sequence classifiers (pooling models: runner="pooling", LLM.classify / LLM.score).
MODEL_ARCHITECTURES.update(
    {
        f"{name}ForSequenceClassification": (
            f"paged_llm.models.classification.{name}ForSequenceClassification"
        )
        for name in (
            "Llama",
            "Mistral",
            "Qwen2",
            "Qwen3",
            "Mixtral",
            "Qwen2Moe",
            "Qwen3Moe",
            "OPT",
            "GPT2",
            "GPTNeoX",
        )
    }
)
# Bare decoders without a head (embedding checkpoints such as e5-mistral): runner="pooling".
MODEL_ARCHITECTURES.update(
    {
        f"{name}Model": f"paged_llm.models.classification.{name}EmbeddingModel"
        for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "OPT")
    }
)


def supported_architectures() -> list[str]:
    """Architecture names this package can run."""
    return sorted(MODEL_ARCHITECTURES)


def get_model_class(config: Any) -> type[nn.Module]:
    """The model class for ``config.architectures`` (the first supported entry wins)."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_ARCHITECTURES:
            return import_target(MODEL_ARCHITECTURES[arch])
    found = ", ".join(architectures) if architectures else "none (config.architectures is missing)"
    supported = ", ".join(supported_architectures())
    raise ValueError(f"unsupported model architecture: {found}; supported: {supported}")
