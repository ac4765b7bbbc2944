"""GPT-NeoX (Black et al. 2022) and the Pythia suite trained with it: LayerNorm, partial rotary
embeddings (``partial_rotary_factor``, Pythia's ``rotary_pct`` = 0.25), a GELU MLP, multi-head
attention, and by default a parallel residual: x + attn(ln1(x)) + mlp(ln2(x)).

The checkpoint's fused ``query_key_value`` is laid out per head as [q, k, v] blocks of
head_dim rows; it is split into q/k/v while loading so tensor parallelism can split heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paged_llm.distributed.layers import column_linear, lm_head, row_linear, vocab_embedding
from paged_llm.distributed.sharding import shard_heads
from paged_llm.layers.activation import get_activation
from paged_llm.layers.attention import ForwardContext, PagedAttention
from paged_llm.layers.linear import sibling_outputs
from paged_llm.layers.rope_scaling import rope_parameters
from paged_llm.layers.rotary import RotaryEmbedding, apply_rotary_qk
from paged_llm.models.base import CausalLM


def split_query_key_value(rows: torch.Tensor, heads: int) -> list[tuple[str, torch.Tensor]]:
    """The fused ``query_key_value``'s output rows [3H, ...] (weight, bias, or a LoRA B) as the
    q, k and v layers' rows: per head, head_dim rows of q, then of k, then of v."""
    rest = rows.shape[1:]
    per_head = rows.reshape(heads, 3, -1, *rest)  # [heads, q|k|v, head_dim, ...]
    return [(name, per_head[:, i].reshape(-1, *rest))
            for i, name in enumerate(("q_proj", "k_proj", "v_proj"))]  # fmt: skip


class GPTNeoXAttention(nn.Module):
    """q/k/v (column-parallel), partial RoPE on q and k, paged attention, dense (row-parallel)."""

    sibling_linears = (("q_proj", "k_proj", "v_proj"),)  # one GEMM where they merge

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        bias = getattr(config, "attention_bias", True)
        self.num_heads = shard_heads(heads, heads).num_heads
        self.q_proj = column_linear(hidden, hidden, bias)
        self.k_proj = column_linear(hidden, hidden, bias)
        self.v_proj = column_linear(hidden, hidden, bias)
        self.dense = row_linear(hidden, hidden, bias)
        self.attn = PagedAttention(
            self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5, layer_idx
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, H], cos/sin [T, R] -> [T, H]
        """Attend every token to its sequence's cached context (this step's K/V included)."""
        t = x.shape[0]
        q, k, v = sibling_outputs(self, self.sibling_linears[0], x)
        heads = (t, self.num_heads, self.head_dim)
        q, k = apply_rotary_qk(q.view(heads), k.view(heads), cos, sin)
        return self.dense(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, ctx))


class GPTNeoXMLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x))): column- then row-parallel."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense_h_to_4h = column_linear(config.hidden_size, config.intermediate_size, True)
        self.dense_4h_to_h = row_linear(config.intermediate_size, config.hidden_size, True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Apply the MLP row-wise."""
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    """A block with a parallel (attention and MLP read the same x) or sequential residual."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attention = GPTNeoXAttention(config, layer_idx)
        self.mlp = GPTNeoXMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        """Run one transformer block."""
        attn = self.attention(self.input_layernorm(x), cos, sin, ctx)
        if self.use_parallel_residual:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXModel(nn.Module):
    """Token embeddings, the layers and the final LayerNorm (HF's ``gpt_neox.*``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_in = vocab_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GPTNeoXLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters(config))  # [T, R] tables

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, H]
        """Hidden states after the final LayerNorm for every token of the flat batch."""
        x = self.embed_in(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.final_layer_norm(x)


class GPTNeoXForCausalLM(CausalLM):
    """GPT-NeoX / Pythia with its LM head (``embed_out``, untied unless the config ties it)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.gpt_neox = GPTNeoXModel(config)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)  # the checkpoint's embed_out
        self.tie_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table."""
        return self.gpt_neox.embed_in

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, H]
        """Final hidden states of the flat batch; pass the rows to sample to compute_logits."""
        return self.gpt_neox(input_ids, positions, ctx)

    def lora_tensors(
        self, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """A PEFT adapter of the fused ``query_key_value`` adapts q, k and v: the same A, and
        B's rows per head split as the weight is; other modules map one to one."""
        if not module.endswith("attention.query_key_value") or b.dim() != 2:
            return [(module, a, b)]
        if b.shape[0] != 3 * self.config.hidden_size:
            return [(module, a, b)]  # the shape check names the mismatch
        prefix = module.removesuffix("query_key_value")
        heads = self.config.num_attention_heads
        return [(prefix + name, a, piece) for name, piece in split_query_key_value(b, heads)]

    def export_name(self, name: str) -> str:
        """Our ``lm_head`` is the checkpoint's ``embed_out``."""
        return "embed_out." + name.removeprefix("lm_head.") if name.startswith("lm_head.") else name

    def fused_linears(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """Each layer's ``query_key_value`` holds q, k and v interleaved per head."""
        parts = split_query_key_value(
            torch.arange(3 * self.config.hidden_size), self.config.num_attention_heads
        )
        fused = {}
        for i in range(self.config.num_hidden_layers):
            prefix = f"gpt_neox.layers.{i}.attention."
            fused[prefix + "query_key_value"] = [(prefix + part, idx) for part, idx in parts]
        return fused

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str | None, torch.Tensor]]:
        """HF names -> ours: ``embed_out`` is ``lm_head``, ``query_key_value`` is split into
        q/k/v per head, and buffers older checkpoints saved (causal mask, rotary frequencies)
        are dropped."""
        heads = self.config.num_attention_heads
        for name, tensor in weights:
            if name.endswith((".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")):
                continue
            if name.startswith("embed_out."):
                yield "lm_head." + name.removeprefix("embed_out."), tensor
            elif ".attention.query_key_value." in name:
                prefix, kind = name.split("query_key_value.")
                for part, piece in split_query_key_value(tensor, heads):
                    yield f"{prefix}{part}.{kind}", piece
            else:
                yield name, tensor
