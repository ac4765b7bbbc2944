"""Model shapes for the cost model: what a step reads (weights, KV cache) and computes.
Presets are plain numbers; :func:`from_hf_config` derives a shape from any transformers config.
Plain Python (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that matter for memory traffic and FLOPs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    num_params: int
    vocab_size: int
    max_model_len: int = 2048
    dtype_bytes: int = 2  # fp16 as in the paper

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer (OPT-13B: 2 x 5120 x 40 x 2 B = 800 KiB)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters (read once per step)."""
        return self.num_params * self.dtype_bytes

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs of the matmuls for one token (2 per parameter, the LM head included)."""
        return 2 * self.num_params

    @property
    def attn_flops_per_token_pair(self) -> int:
        """FLOPs of QK^T and PV for one (query, key) pair across all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (with the derived byte counts) for result files."""
        d = asdict(self)
        d.update(kv_bytes_per_token=self.kv_bytes_per_token, weight_bytes=self.weight_bytes)
        return d


def opt_params(
    hidden: int, layers: int, ffn: int, vocab: int = 50272, positions: int = 2048
) -> int:
    """Parameters of an OPT model (tied head, biases, pre-LN, final LayerNorm)."""
    layer = 4 * (hidden * hidden + hidden) + 2 * hidden * ffn + ffn + hidden + 4 * hidden
    return vocab * hidden + (positions + 2) * hidden + layers * layer + 2 * hidden


def llama_params(hidden: int, layers: int, inter: int, vocab: int = 32000) -> int:
    """Parameters of a LLaMA-1 model (untied head, no biases, RMSNorm)."""
    layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    return 2 * vocab * hidden + layers * layer + hidden


def _opt(name: str, hidden: int, layers: int, heads: int) -> ModelShape:
    params = opt_params(hidden, layers, 4 * hidden)
    return ModelShape(name, layers, hidden, heads, heads, params, 50272)


def _llama(name: str, hidden: int, inter: int, layers: int, heads: int) -> ModelShape:
    params = llama_params(hidden, layers, inter)
    return ModelShape(name, layers, hidden, heads, heads, params, 32000)


MODEL_SHAPES: dict[str, ModelShape] = {
    "opt-13b": _opt("OPT-13B", 5120, 40, 40),
    "opt-66b": _opt("OPT-66B", 9216, 64, 72),
    "opt-175b": _opt("OPT-175B", 12288, 96, 96),
    "llama-7b": _llama("LLaMA-7B", 4096, 11008, 32, 32),
    "llama-13b": _llama("LLaMA-13B", 5120, 13824, 40, 40),
}


def get_model_shape(name: str, **overrides: Any) -> ModelShape:
    """A preset by name (e.g. ``opt-13b``), with optional field overrides."""
    key = name.lower()
    if key not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape '{name}'; choose one of {sorted(MODEL_SHAPES)}")
    return replace(MODEL_SHAPES[key], **overrides) if overrides else MODEL_SHAPES[key]


def from_hf_config(config: Any, name: str | None = None, dtype_bytes: int = 2) -> ModelShape:
    """The shape of a transformers config (OPT or LLaMA family), parameters counted exactly."""
    from paged_llm.models.presets import count_parameters  # imports torch; only on this path

    if getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0):
        # The roofline reads every weight once per iteration; an MoE reads only the experts
        # its batch routes to, which this shape cannot express.
        raise ValueError(
            f"the cost model describes dense models; '{config.model_type}' is a "
            "mixture-of-experts model"
        )
    heads = config.num_attention_heads
    return ModelShape(
        name=name or getattr(config, "name_or_path", "") or config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        num_params=count_parameters(config),
        vocab_size=config.vocab_size,
        max_model_len=config.max_position_embeddings,
        dtype_bytes=dtype_bytes,
    )
