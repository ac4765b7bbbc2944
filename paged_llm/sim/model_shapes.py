"""Model shapes for the cost model: what a step reads (weights, KV cache) and computes.
Presets are plain numbers; :func:`from_hf_config` derives a shape from any transformers config.
Plain Python (no torch).

Mixture-of-experts shapes (``num_experts`` > 0) store all experts but route each token to
``experts_per_token`` of them: a step's FLOPs follow the active parameters, and the weights it
reads follow the experts its tokens touch. With routing spread evenly and independently, a
step of B tokens touches E * (1 - (1 - k/E)^B) experts of each sparse layer in expectation.

A sliding window (``sliding_window`` W, on every layer: Mistral v0.1) caps what attention reads
at each token's last W positions; the paged policy also frees the blocks behind the window
(``ServingSettings.free_blocks_behind_window``), as the engine does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from paged_llm.utils.checks import check_window


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
    # mixture of experts: experts per sparse layer, experts each token runs, and the parameters
    # of one expert summed over the sparse layers (included in num_params E times)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    sliding_window: int | None = None  # every layer attends to its last W positions only

    def __post_init__(self) -> None:
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token must be in [1, num_experts={self.num_experts}], got "
                f"{self.experts_per_token}"
            )
        if self.num_experts * self.expert_params > self.num_params:
            raise ValueError("the experts' parameters exceed num_params")
        check_window(self.sliding_window)

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
        """Bytes of the parameters (what the GPU must hold; a dense step reads them all)."""
        return self.num_params * self.dtype_bytes

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (all of them for a dense model)."""
        return self.num_params - (self.num_experts - self.experts_per_token) * self.expert_params

    def experts_touched(self, num_tokens: int) -> float:
        """Expected experts per sparse layer that ``num_tokens`` tokens route to."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** num_tokens)

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Bytes of weights a step of ``num_tokens`` tokens reads: every dense parameter, and
        the experts its tokens touch."""
        dense = self.num_params - self.num_experts * self.expert_params
        return (dense + self.experts_touched(num_tokens) * self.expert_params) * self.dtype_bytes

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs of the matmuls for one token (2 per active parameter, the LM head included)."""
        return 2 * self.active_params

    @property
    def attn_flops_per_token_pair(self) -> int:
        """FLOPs of QK^T and PV for one (query, key) pair across all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (with the derived byte counts) for result files."""
        d = asdict(self)
        d.update(kv_bytes_per_token=self.kv_bytes_per_token, weight_bytes=self.weight_bytes,
                 active_params=self.active_params)  # fmt: skip
        return d


def opt_params(
    hidden: int, layers: int, ffn: int, vocab: int = 50272, positions: int = 2048
) -> int:
    """Parameters of an OPT model (tied head, biases, pre-LN, final LayerNorm)."""
    layer = 4 * (hidden * hidden + hidden) + 2 * hidden * ffn + ffn + hidden + 4 * hidden
    return vocab * hidden + (positions + 2) * hidden + layers * layer + 2 * hidden


def llama_params(
    hidden: int, layers: int, inter: int, vocab: int = 32000, kv_dim: int | None = None
) -> int:
    """Parameters of a LLaMA-style model (untied head, no biases, RMSNorm); ``kv_dim``: the
    width of k and v under grouped-query attention (Mistral 7B: 1024; None: ``hidden``)."""
    kv_dim = hidden if kv_dim is None else kv_dim
    layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    return 2 * vocab * hidden + layers * layer + hidden


def mixtral_shape(
    name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, experts: int,
    top_k: int, vocab: int = 32000,
) -> ModelShape:  # fmt: skip
    """A Mixtral-style shape: GQA attention, untied head, every layer's MLP a mixture of
    ``experts`` SwiGLU experts of intermediate size ``inter``."""
    head_dim = hidden // heads
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    expert = 3 * hidden * inter
    layer = attn + experts * expert + experts * hidden + 2 * hidden  # + router, norms
    params = 2 * vocab * hidden + layers * layer + hidden
    return ModelShape(name, layers, hidden, heads, kv_heads, params, vocab, max_model_len=32768,
                      num_experts=experts, experts_per_token=top_k,
                      expert_params=layers * expert)  # fmt: skip


def _opt(name: str, hidden: int, layers: int, heads: int) -> ModelShape:
    params = opt_params(hidden, layers, 4 * hidden)
    return ModelShape(name, layers, hidden, heads, heads, params, 50272)


def _llama(name: str, hidden: int, inter: int, layers: int, heads: int) -> ModelShape:
    params = llama_params(hidden, layers, inter)
    return ModelShape(name, layers, hidden, heads, heads, params, 32000)


MODEL_SHAPES: dict[str, ModelShape] = {
    "opt-2.7b": _opt("OPT-2.7B", 2560, 32, 32),
    "opt-6.7b": _opt("OPT-6.7B", 4096, 32, 32),
    "opt-13b": _opt("OPT-13B", 5120, 40, 40),
    "opt-66b": _opt("OPT-66B", 9216, 64, 72),
    "opt-175b": _opt("OPT-175B", 12288, 96, 96),
    "llama-7b": _llama("LLaMA-7B", 4096, 11008, 32, 32),
    "llama-13b": _llama("LLaMA-13B", 5120, 13824, 40, 40),
    # 46.7B parameters, 12.9B active (Mistral AI's figures)
    "mixtral-8x7b": mixtral_shape("Mixtral-8x7B", 4096, 14336, 32, 32, 8, 8, 2),
    # 7.24B parameters; every layer attends to its last 4096 positions
    "mistral-7b": ModelShape(
        "Mistral-7B-v0.1",
        32,
        4096,
        32,
        8,
        llama_params(4096, 32, 14336, kv_dim=1024),
        32000,
        max_model_len=32768,
        sliding_window=4096,
    ),  # fmt: skip
}


def get_model_shape(name: str, **overrides: Any) -> ModelShape:
    """A preset by name (e.g. ``opt-13b``), with optional field overrides."""
    key = name.lower()
    if key not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape '{name}'; choose one of {sorted(MODEL_SHAPES)}")
    return replace(MODEL_SHAPES[key], **overrides) if overrides else MODEL_SHAPES[key]


def from_hf_config(config: Any, name: str | None = None, dtype_bytes: int = 2) -> ModelShape:
    """The shape of a transformers config (OPT or LLaMA family), parameters counted exactly."""
    from paged_llm.models.loader import sliding_window_of  # imports torch; only on this path
    from paged_llm.models.presets import count_parameters

    experts = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0)
    moe: dict[str, int] = {}
    if experts:
        from paged_llm.models.moe import qwen_moe_layer_is_sparse

        mixtral = config.model_type == "mixtral"
        inter = config.intermediate_size if mixtral else config.moe_intermediate_size
        sparse = sum(mixtral or qwen_moe_layer_is_sparse(config, i)
                     for i in range(config.num_hidden_layers))  # fmt: skip
        moe = dict(num_experts=experts, experts_per_token=config.num_experts_per_tok,
                   expert_params=sparse * 3 * config.hidden_size * inter)  # fmt: skip
    heads = config.num_attention_heads
    windows = {sliding_window_of(config, i) for i in range(config.num_hidden_layers)}
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
        # a window on every layer (a mix of windowed and full layers counts as full)
        sliding_window=windows.pop() if len(windows) == 1 else None,
        **moe,
    )
