"""GPT-2 (Radford et al. 2019): learned absolute positions, pre-LayerNorm blocks, a GELU (tanh)
MLP, multi-head attention, LM head tied to the token embeddings.

HF checkpoints store the projections as ``Conv1D`` weights ([in, out], the transpose of a
linear layer) and q/k/v fused in one ``c_attn``. They are transposed and split into q/k/v while
loading (``checkpoint_tensors``), so the model uses plain linear layers and tensor parallelism
splits q, k and v by heads like every other model here.
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
from paged_llm.models.base import CausalLM

# Conv1D modules: their 2-D weights are [in, out] in the checkpoint
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_BARE = ("wte.", "wpe.", "h.", "ln_f.")  # GPT2Model's tensors, without "transformer."


def split_c_attn(rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The fused ``c_attn``'s output rows [3H, ...] (weight, bias, or a LoRA B) as the q, k and
    v layers' rows: three consecutive thirds."""
    return list(zip(("q_proj", "k_proj", "v_proj"), rows.chunk(3, dim=0)))


class GPT2Attention(nn.Module):
    """Multi-head attention with biased q/k/v (column-parallel) and c_proj (row-parallel)."""

    sibling_linears = (("q_proj", "k_proj", "v_proj"),)  # one GEMM where they merge

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        self.q_proj = column_linear(hidden, hidden, True)
        self.k_proj = column_linear(hidden, hidden, True)
        self.v_proj = column_linear(hidden, hidden, True)
        self.c_proj = row_linear(hidden, hidden, True)
        scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):  # Stanford CRFM's runs
            scale /= layer_idx + 1
        local_heads = shard_heads(heads, heads).num_heads
        self.attn = PagedAttention(local_heads, local_heads, head_dim, scale, layer_idx)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, H] -> [T, H]
        """Attend every token to its sequence's cached context (this step's K/V included)."""
        q, k, v = sibling_outputs(self, self.sibling_linears[0], x)
        return self.c_proj(self.attn(q, k, v, ctx))


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x))), c_fc column- and c_proj row-parallel."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.c_fc = column_linear(hidden, inner, True)
        self.c_proj = row_linear(inner, hidden, True)
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Apply the MLP row-wise."""
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, H] -> [T, H]
        """Run one transformer block."""
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Token + position embeddings, the blocks and the final LayerNorm (HF's ``transformer``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = vocab_embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, H]
        """Hidden states after the final LayerNorm for every token of the flat batch."""
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, ctx)
        return self.ln_f(x)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with its LM head (tied to ``wte`` in every released size)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        self.tie_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table."""
        return self.transformer.wte

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, H]
        """Final hidden states of the flat batch; pass the rows to sample to compute_logits."""
        return self.transformer(input_ids, positions, ctx)

    def lora_tensors(
        self, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """A PEFT adapter of the fused ``c_attn`` ([3H, r] B) adapts q, k and v: the same A,
        B's thirds; other modules map one to one."""
        if not module.endswith("attn.c_attn") or b.dim() != 2 or b.shape[0] % 3:
            return [(module, a, b)]
        prefix = module.removesuffix("c_attn")
        return [(prefix + name, a, piece) for name, piece in split_c_attn(b)]

    def fused_linears(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """Each block's ``c_attn`` holds q, k and v as consecutive thirds of its outputs."""
        parts = split_c_attn(torch.arange(3 * self.config.hidden_size))
        fused = {}
        for i in range(self.config.num_hidden_layers):
            prefix = f"transformer.h.{i}.attn."
            fused[prefix + "c_attn"] = [(prefix + part, idx) for part, idx in parts]
        return fused

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str | None, torch.Tensor]]:
        """HF names -> ours: Conv1D weights transposed, ``c_attn`` split into q/k/v, the
        causal-mask buffers older checkpoints saved dropped; checkpoints saved from the bare
        ``GPT2Model`` (openai-community/gpt2) get the ``transformer.`` prefix."""
        for name, tensor in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # the causal mask, a buffer
            if name.startswith(_BARE):  # saved from the bare GPT2Model
                name = "transformer." + name
            module = name.rsplit(".", 1)[0]
            if module.endswith(_CONV1D) and name.endswith(".weight"):
                tensor = tensor.t()  # [in, out] -> [out, in] (packed int4 tensors are [in, out])
            if module.endswith("attn.c_attn"):
                prefix, kind = module.removesuffix("c_attn"), name.rsplit(".", 1)[1]
                for part, piece in split_c_attn(tensor):
                    yield f"{prefix}{part}.{kind}", piece
                continue
            yield name, tensor
