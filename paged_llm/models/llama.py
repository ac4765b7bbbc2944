"""LLaMA-family decoder (LLaMA 1/2/3, Mistral, Qwen2, Qwen3): RMSNorm, RoPE, grouped-query
attention over the paged KV cache, and a SwiGLU MLP. The variants differ in which projections
carry a bias, whether q and k are RMS-normed per head (Qwen3), and which MLP a layer has (the
mixture-of-experts models in ``moe.py``); the subclasses (``llama_variants.py``: Mistral,
Qwen2, Qwen3) pick.

Sliding-window attention (Mistral v0.1, Qwen2/3 with ``use_sliding_window``) is a per-layer
argument of the attention layer (``loader.sliding_window_of``); every backend honours it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged_llm.distributed.layers import column_linear, lm_head, row_linear, vocab_embedding
from paged_llm.distributed.sharding import shard_heads
from paged_llm.layers.activation import get_activation
from paged_llm.layers.attention import ForwardContext, PagedAttention
from paged_llm.layers.linear import sibling_outputs
from paged_llm.layers.norms import RMSNorm
from paged_llm.layers.rope_scaling import rope_parameters
from paged_llm.layers.rotary import RotaryEmbedding, apply_rotary_qk
from paged_llm.models.base import CausalLM
from paged_llm.models.loader import head_dim_of, num_kv_heads_of, sliding_window_of
from paged_llm.ops.elementwise import BindsElementwiseOps, device_of, rotary_for, silu_mul_for


class LlamaAttention(BindsElementwiseOps):
    """q/k/v projections, RoPE on q and k, paged attention, output projection.

    Under tensor parallelism each rank owns a slice of the heads (num_heads / num_kv_heads are
    this rank's counts): q/k/v are column-parallel, o_proj row-parallel (see distributed/).
    """

    sibling_linears = (("q_proj", "k_proj", "v_proj"),)  # one GEMM where they merge

    def __init__(
        self, config: Any, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool = False
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = head_dim_of(config)
        q_dim = config.num_attention_heads * self.head_dim
        kv_dim = num_kv_heads_of(config) * self.head_dim
        heads = shard_heads(config.num_attention_heads, num_kv_heads_of(config))
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        kv_rows = heads.kv_rows(self.head_dim)  # K/V heads may be replicated across ranks
        self.q_proj = column_linear(hidden, q_dim, qkv_bias)
        self.k_proj = column_linear(hidden, kv_dim, qkv_bias, rows=kv_rows)
        self.v_proj = column_linear(hidden, kv_dim, qkv_bias, rows=kv_rows)
        self.o_proj = row_linear(q_dim, hidden, o_bias)
        if qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_idx,
            sliding_window=sliding_window_of(config, layer_idx),
        )  # fmt: skip
        self.bind_ops(device_of(self))

    def bind_ops(self, device: torch.device) -> None:
        """The fused rotary kernel on CUDA, the torch reference elsewhere (ops/elementwise)."""
        self._rotate = rotary_for(device)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H]
        """Attend every token to its sequence's cached context (this step's K/V included)."""
        t = x.shape[0]
        q, k, v = sibling_outputs(self, self.sibling_linears[0], x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_qk(q, k, cos, sin, self._rotate)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, ctx)  # [T, Hq * D]
        return self.o_proj(out)


class LlamaMLP(BindsElementwiseOps):
    """Gated MLP: down(act(gate(x)) * up(x)); gate/up column-, down row-parallel under TP."""

    sibling_linears = (("gate_proj", "up_proj"),)  # one GEMM where they merge

    def __init__(self, config: Any, bias: bool, intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = column_linear(hidden, inter, bias)
        self.up_proj = column_linear(hidden, inter, bias)
        self.down_proj = row_linear(inter, hidden, bias)
        self.act_fn = get_activation(config.hidden_act)
        self.silu = config.hidden_act in ("silu", "swish")  # one fused kernel on CUDA
        self.bind_ops(device_of(self))

    def bind_ops(self, device: torch.device) -> None:
        """The fused SwiGLU-gate kernel on CUDA, the torch reference elsewhere (ops/elementwise)."""
        self._silu_mul = silu_mul_for(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Apply the gated MLP row-wise."""
        gate, up = sibling_outputs(self, self.sibling_linears[0], x)
        if self.silu:
            return self.down_proj(self._silu_mul(gate, up))
        return self.down_proj(self.act_fn(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    ``variant`` is the model class: its ``bias_flags``, ``qk_norm`` and ``make_mlp`` say how
    this architecture's blocks differ from LLaMA's.
    """

    def __init__(self, config: Any, layer_idx: int, variant: type[LlamaForCausalLM]) -> None:
        super().__init__()
        qkv_bias, o_bias, _ = variant.bias_flags(config)
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, o_bias, variant.qk_norm)
        self.mlp = variant.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        """Run one transformer block."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, the decoder stack and the final norm (HF's ``model.*`` namespace)."""

    def __init__(self, config: Any, variant: type[LlamaForCausalLM]) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, variant) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One RoPE table for all layers: cos/sin depend only on positions, so compute them once.
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, H]
        """Hidden states after the final norm for every token of the flat batch."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """LLaMA with an LM head; also the base of the Mistral, Qwen2/3 and MoE variants."""

    qk_norm = False  # RMSNorm on each head's q and k (Qwen3)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, type(self))
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        self.tie_weights()

    @staticmethod
    def bias_flags(config: Any) -> tuple[bool, bool, bool]:
        """(q/k/v bias, o_proj bias, MLP bias); LLaMA takes both from the config."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return attention_bias, attention_bias, bool(getattr(config, "mlp_bias", False))

    @classmethod
    def make_mlp(cls, config: Any, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx``: LLaMA's gated MLP in every layer."""
        return LlamaMLP(config, cls.bias_flags(config)[2])

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table."""
        return self.model.embed_tokens

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, H]
        """Final hidden states of the flat batch; pass the rows to sample to compute_logits."""
        return self.model(input_ids, positions, ctx)

    def checkpoint_name(self, name: str) -> str | None:
        """Drop RoPE frequency buffers that older checkpoints saved; other names are HF's own."""
        return None if name.endswith("rotary_emb.inv_freq") else name
