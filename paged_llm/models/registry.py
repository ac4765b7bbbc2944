"""HF ``architectures`` names (from config.json) -> our model classes."""

from __future__ import annotations

from typing import Any

from torch import nn

from paged_llm.utils.registry import check_import_path, import_target

# Import paths, not classes, so looking up one architecture does not import every model file.
MODEL_ARCHITECTURES: dict[str, str | type[nn.Module]] = {
    "LlamaForCausalLM": "paged_llm.models.llama.LlamaForCausalLM",
    "MistralForCausalLM": "paged_llm.models.llama_variants.MistralForCausalLM",
    "Qwen2ForCausalLM": "paged_llm.models.llama_variants.Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "paged_llm.models.llama_variants.Qwen3ForCausalLM",
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


class ModelRegistry:
    """vLLM's ``ModelRegistry``: add an architecture from outside the package, e.g.
    ``ModelRegistry.register_model("MyLlamaForCausalLM", "my_pkg.models.MyLlama")`` (or the
    class itself). ``LLM(..., model_classes={...})`` does the same from configuration alone."""

    @staticmethod
    def register_model(architecture: str, model_cls: str | type[nn.Module]) -> None:
        """Run checkpoints whose config.json names ``architecture`` with ``model_cls`` (a class,
        or its import path as ``pkg.module.Class`` or vLLM's ``pkg.module:Class``)."""
        if not isinstance(architecture, str) or not architecture:
            raise ValueError(f"an architecture name must be a non-empty string: {architecture!r}")
        if isinstance(model_cls, str):
            model_cls = check_import_path(model_cls)
        elif not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            raise ValueError(
                f"model class for {architecture!r} must be an nn.Module subclass or its import "
                f"path, got {model_cls!r}"
            )
        MODEL_ARCHITECTURES[architecture] = model_cls

    @staticmethod
    def get_supported_archs() -> list[str]:
        """Every architecture name that can run, built in or registered."""
        return supported_architectures()


def register_models(model_classes: dict[str, str] | None) -> None:
    """Register a configuration's ``model_classes`` (architecture -> import path); each process
    that loads a model calls this, so tensor-parallel ranks know them too."""
    for architecture, target in (model_classes or {}).items():
        ModelRegistry.register_model(architecture, target)


def supported_architectures() -> list[str]:
    """Architecture names this package can run."""
    return sorted(MODEL_ARCHITECTURES)


def get_model_class(config: Any) -> type[nn.Module]:
    """The model class for ``config.architectures`` (the first supported entry wins)."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_ARCHITECTURES:
            target = MODEL_ARCHITECTURES[arch]
            return import_target(target) if isinstance(target, str) else target
    found = ", ".join(architectures) if architectures else "none (config.architectures is missing)"
    supported = ", ".join(supported_architectures())
    raise ValueError(f"unsupported model architecture: {found}; supported: {supported}")
