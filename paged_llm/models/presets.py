"""Built-in model presets: HF configs with the exact shapes of well-known models, for experiments
where only shapes matter (memory, throughput), plus a ~1.3M-parameter "tiny" LLaMA that ships
with a trained tokenizer so text prompts work offline.

Two ways to get a model from a preset:

* :func:`materialize_preset` writes a random-initialised HF checkpoint directory (via
  transformers' own model class and ``save_pretrained``), which then loads through
  :func:`paged_llm.models.loader.load_model` exactly like a downloaded checkpoint. It refuses
  presets over ``MAX_MATERIALIZE_PARAMS``: OPT-13B / LLaMA-7B / LLaMA-13B would be 13-52 GB.
* :func:`build_random_model` builds our model directly on the target device with random
  weights and writes nothing to disk; use it for the big presets.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_llm.layers.norms import RMSNorm
from paged_llm.models.loader import head_dim_of, instantiate_model, num_kv_heads_of
from paged_llm.models.tokenizer_builder import CHAT_TEMPLATE, DEFAULT_VOCAB_SIZE, build_tokenizer
from paged_llm.recipes.cache import cache_root

DEFAULT_PRESET = "tiny"
MAX_MATERIALIZE_PARAMS = 1_500_000_000
# Bump when the tiny preset or its tokenizer changes, so stale cache entries are not reused.
# v2: the tokenizer carries the built-in chat template (the weights are v1's).
TINY_CACHE_VERSION = "v2"


def _opt(hidden: int, layers: int, heads: int) -> Any:
    from transformers import OPTConfig

    # All released OPT sizes: vocab 50272, 2048 positions, ffn = 4 * hidden, tied head, ReLU.
    return OPTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=4 * hidden,
        vocab_size=50272,
        max_position_embeddings=2048,
        word_embed_proj_dim=hidden,
        do_layer_norm_before=True,
        architectures=["OPTForCausalLM"],
    )


def _llama(hidden: int, inter: int, layers: int, heads: int) -> Any:
    from transformers import LlamaConfig

    # LLaMA-1 shapes: vocab 32000, 2048 positions, untied head, rms eps 1e-6.
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=32000,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        architectures=["LlamaForCausalLM"],
    )


def _tiny() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # exercise grouped-query attention even in the smoke model
        vocab_size=DEFAULT_VOCAB_SIZE,  # the tokenizer from tokenizer_builder
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )


PRESETS: dict[str, Callable[[], Any]] = {
    "tiny": _tiny,
    "opt-125m": lambda: _opt(768, 12, 12),
    "opt-1.3b": lambda: _opt(2048, 24, 32),
    "opt-2.7b": lambda: _opt(2560, 32, 32),  # OPT-2.7B / 6.7B: real-mode figures on 24 GB cards
    "opt-6.7b": lambda: _opt(4096, 32, 32),
    "opt-13b": lambda: _opt(5120, 40, 40),
    "llama-7b": lambda: _llama(4096, 11008, 32, 32),
    "llama-13b": lambda: _llama(5120, 13824, 40, 40),
}


def list_presets() -> list[str]:
    """Names accepted by :func:`preset_config`."""
    return list(PRESETS)


def preset_config(name: str) -> Any:
    """A fresh HF config object for preset ``name``."""
    try:
        return PRESETS[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown model preset '{name}'; choose one of {list_presets()}") from None


def count_parameters(config: Any) -> int:
    """Parameter count implied by a config of a supported family (a tied head counted once)."""
    if config.model_type == "opt":
        return _count_opt(config)
    if config.model_type in ("llama", "mistral", "qwen2", "qwen3", *_MOE_TYPES):
        return _count_llama(config)
    if config.model_type in ("gpt2", "gpt_neox"):
        return _count_gpt(config)
    raise ValueError(f"cannot count parameters of model type '{config.model_type}'")


def _count_gpt(c: Any) -> int:
    """GPT-2 / GPT-NeoX: biased MHA and a plain MLP, two LayerNorms a layer, a final one;
    GPT-2 adds a position table."""
    h, v = c.hidden_size, c.vocab_size
    if c.model_type == "gpt2":
        inner, bias = getattr(c, "n_inner", None) or 4 * h, True
        positions = c.max_position_embeddings * h
    else:
        inner, bias, positions = c.intermediate_size, getattr(c, "attention_bias", True), 0
    attn = 4 * h * h + (4 * h if bias else 0)
    mlp = 2 * h * inner + inner + h
    layers = c.num_hidden_layers * (attn + mlp + 4 * h)
    head = 0 if c.tie_word_embeddings else v * h
    return v * h + positions + layers + 2 * h + head


_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _count_llama(c: Any) -> int:
    """LLaMA-family count: attention (biases, Qwen3's q/k norms) + each layer's MLP or experts."""
    h, v = c.hidden_size, c.vocab_size
    q_dim = c.num_attention_heads * head_dim_of(c)
    kv_dim = num_kv_heads_of(c) * head_dim_of(c)
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if c.model_type == "qwen2" or (c.model_type == "qwen2_moe" and getattr(c, "qkv_bias", True)):
        attn += q_dim + 2 * kv_dim
    elif getattr(c, "attention_bias", False):
        attn += q_dim + 2 * kv_dim + h
    if c.model_type in ("qwen3", "qwen3_moe"):
        attn += 2 * head_dim_of(c)  # q_norm, k_norm
    mlps = sum(_count_mlp(c, i) for i in range(c.num_hidden_layers))
    layers = c.num_hidden_layers * (attn + 2 * h)  # + two RMSNorm weights per layer
    head = 0 if c.tie_word_embeddings else v * h
    return v * h + layers + mlps + h + head


def _count_mlp(c: Any, layer_idx: int) -> int:
    """Parameters of layer ``layer_idx``'s feed-forward block: a gated MLP, or the router, the
    experts and (Qwen2-MoE) the gated shared expert."""
    h = c.hidden_size
    if c.model_type == "mixtral":
        return c.num_local_experts * (3 * h * c.intermediate_size + h)
    if c.model_type in ("qwen2_moe", "qwen3_moe"):
        from paged_llm.models.moe import qwen_moe_layer_is_sparse

        if qwen_moe_layer_is_sparse(c, layer_idx):
            experts = c.num_experts * (3 * h * c.moe_intermediate_size + h)
            shared = (
                3 * h * c.shared_expert_intermediate_size + h if c.model_type == "qwen2_moe" else 0
            )
            return experts + shared
    inter = c.intermediate_size
    return 3 * h * inter + (2 * inter + h if getattr(c, "mlp_bias", False) else 0)


def _count_opt(c: Any) -> int:
    h, f, v = c.hidden_size, c.ffn_dim, c.vocab_size
    p = c.word_embed_proj_dim or h
    bias = getattr(c, "enable_bias", True)
    norm = 2 * h if getattr(c, "layer_norm_elementwise_affine", True) else 0
    layer = 4 * (h * h + (h if bias else 0)) + h * f + f * h + ((f + h) if bias else 0) + 2 * norm
    total = v * p + (c.max_position_embeddings + 2) * h + c.num_hidden_layers * layer
    total += 2 * p * h if p != h else 0  # project_in / project_out
    total += (
        norm if c.do_layer_norm_before and not getattr(c, "_remove_final_layer_norm", False) else 0
    )
    total += 0 if c.tie_word_embeddings else v * p
    return total


def materialize_preset(
    name: str, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Write preset ``name`` as a random-initialised HF checkpoint (config.json +
    model.safetensors, and the tokenizer for "tiny") into ``out_dir``; return ``out_dir``."""
    from transformers import AutoModelForCausalLM

    config = preset_config(name)
    num_params = count_parameters(config)
    if num_params > MAX_MATERIALIZE_PARAMS:
        raise ValueError(
            f"preset '{name}' has {num_params / 1e9:.1f}B parameters; writing it to disk is "
            "not supported, use build_random_model() to create it directly in memory"
        )
    out_dir = Path(out_dir)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        hf_model = AutoModelForCausalLM.from_config(config)
    hf_model.to(dtype).save_pretrained(str(out_dir))
    if name.lower() == DEFAULT_PRESET:
        build_tokenizer(out_dir, vocab_size=config.vocab_size, chat_template=CHAT_TEMPLATE)
    return out_dir


def build_random_model(
    name_or_config: str | Any,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, Any]:
    """Our model for a preset name (or HF config) with random weights, built directly on
    ``device`` without touching the disk; return (model in eval mode, HF config).

    Weights follow HF's scheme (normal(0, 0.02) matrices, zero biases, unit norms) but are
    not bit-identical to :func:`materialize_preset`'s. ``device="meta"`` gives shapes only.
    """
    config = preset_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    model = instantiate_model(config, dtype, device)
    if str(device) != "meta":
        std = getattr(config, "initializer_range", None) or getattr(config, "init_std", 0.02)
        init_random_weights(model, std, seed)
    return model.eval(), config


@torch.no_grad()
def init_random_weights(model: nn.Module, std: float, seed: int) -> None:
    """Fill in place: normal(0, std) linear/embedding weights, zero biases, unit norm weights."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.normal_(0.0, std, generator=gen)
        elif isinstance(module, nn.LayerNorm | RMSNorm) and module.weight is not None:
            module.weight.fill_(1.0)
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter):
            bias.zero_()


def default_model_dir() -> Path:
    """Path of the tiny default model (with tokenizer), materialised once into the cache.

    Safe under concurrent first use: each process writes a private temp directory and renames
    it into place; rename is atomic, and a loser of the race discards its copy.
    """
    final = cache_root() / f"tiny-llama-{TINY_CACHE_VERSION}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=final.parent))
    try:
        materialize_preset(DEFAULT_PRESET, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process got there first (rename onto a non-empty directory fails).
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already gone after a successful rename
    return final
