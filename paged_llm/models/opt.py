"""OPT (Zhang et al. 2022), the model family of the PagedAttention paper's experiments: learned
absolute positions (offset by 2), LayerNorm, ReLU MLP, multi-head attention, tied LM head.

OPT-350m is the odd one out: post-LayerNorm blocks (``do_layer_norm_before=False``) and a
512-wide embedding projected in/out of the 1024-wide decoder; both are supported.
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
from paged_llm.models.base import CausalLM

# OPT's position table reserves two leading rows (a fairseq padding convention), so position p
# reads row p + 2. Checkpoints are laid out that way, hence max_position_embeddings + 2 rows.
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    """Multi-head attention with biased projections (q/k/v column-, out_proj row-parallel)."""

    sibling_linears = (("q_proj", "k_proj", "v_proj"),)  # one GEMM where they merge

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        bias = getattr(config, "enable_bias", True)
        self.scaling = head_dim**-0.5
        self.q_proj = column_linear(hidden, hidden, bias)
        self.k_proj = column_linear(hidden, hidden, bias)
        self.v_proj = column_linear(hidden, hidden, bias)
        self.out_proj = row_linear(hidden, hidden, bias)
        local_heads = shard_heads(heads, heads).num_heads  # all heads, or this rank's share
        # q is scaled before attention (scale=1 inside): HF's and fairseq's order, same rounding.
        self.attn = PagedAttention(local_heads, local_heads, head_dim, 1.0, layer_idx)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, H] -> [T, H]
        """Attend every token to its sequence's cached context (this step's K/V included)."""
        q, k, v = sibling_outputs(self, self.sibling_linears[0], x)
        return self.out_proj(self.attn(q * self.scaling, k, v, ctx))


class OPTDecoderLayer(nn.Module):
    """One block; LayerNorm before (most sizes) or after (350m) each residual branch."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        bias = getattr(config, "enable_bias", True)
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = column_linear(hidden, config.ffn_dim, bias)
        self.fc2 = row_linear(config.ffn_dim, hidden, bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.activation_fn = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, H] -> [T, H]
        """Run one transformer block."""
        pre = self.do_layer_norm_before
        h = self.self_attn(self.self_attn_layer_norm(x) if pre else x, ctx)
        x = x + h
        if not pre:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if pre else x
        x = x + self.fc2(self.activation_fn(self.fc1(h)))
        if not pre:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    """Token + position embeddings, optional in/out projections, the block stack."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        embed_dim = getattr(config, "word_embed_proj_dim", None) or hidden
        self.embed_tokens = vocab_embedding(config.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden
        )
        self.project_in = nn.Linear(embed_dim, hidden, bias=False) if embed_dim != hidden else None
        self.project_out = nn.Linear(hidden, embed_dim, bias=False) if embed_dim != hidden else None
        # Post-LN models already end on a LayerNorm; so do checkpoints fine-tuned before
        # transformers 4.20.1, which HF marks with _remove_final_layer_norm.
        has_final_norm = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False
        )
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = (
            nn.LayerNorm(hidden, elementwise_affine=affine) if has_final_norm else None
        )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, word_embed_proj_dim]
        """Hidden states, projected back to the embedding width, for every token."""
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, ctx)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    """Wrapper that gives parameters HF's ``model.decoder.*`` names."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """See :meth:`OPTDecoder.forward`."""
        return self.decoder(input_ids, positions, ctx)


class OPTForCausalLM(CausalLM):
    """OPT with its LM head (tied to the token embeddings in every released size)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        embed_dim = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        self.model = OPTModel(config)
        self.lm_head = lm_head(embed_dim, config.vocab_size)
        self.tie_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table."""
        return self.model.decoder.embed_tokens

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T], [T] -> [T, word_embed_proj_dim]
        """Final hidden states of the flat batch; pass the rows to sample to compute_logits."""
        return self.model(input_ids, positions, ctx)

    def checkpoint_name(self, name: str) -> str | None:
        """facebook/opt-* checkpoints were saved from OPTModel, so their keys lack ``model.``."""
        return "model." + name if name.startswith("decoder.") else name
