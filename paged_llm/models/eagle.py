"""EAGLE draft head (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): one Llama decoder layer that predicts the target's next final hidden state.

The head reads the target's own features. At position j its input is the pair (x_j, f_{j-1}):
the embedding of token x_j (the target's embedding table) and the target's final hidden state
f_{j-1} at the previous position (zeros at j = 0), joined by ``fc``. It predicts f_j, and the
target's LM head turns the prediction into a distribution over x_{j+1}. To draft further, the
head feeds its own prediction back as the next position's feature.

EAGLE's code puts the pair (x_{j+1}, f_j) at position j; here it sits at j + 1, one position
later for every pair, so the attention is the same (RoPE sees only differences). The shift makes
the head's K/V at position j depend on x_0..x_j alone, like the target's, so the head's cache
can live in the same blocks and be shared by prefix caching.

A head checkpoint is a directory with ``config.json`` (a Llama config of one layer, the
target's sizes, ``architectures: ["EagleLlamaHead"]``) and ``model.safetensors`` with
``fc.weight``, ``layers.0.*`` and ``norm.weight``; the embeddings and LM head are the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_llm.layers.attention import ForwardContext
from paged_llm.layers.norms import RMSNorm
from paged_llm.layers.rope_scaling import rope_parameters
from paged_llm.layers.rotary import RotaryEmbedding
from paged_llm.models.base import load_named_weights
from paged_llm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from paged_llm.models.loader import head_dim_of

ARCHITECTURE = "EagleLlamaHead"


class EagleHead(nn.Module):
    """fc(concat(embed(x_j), f_{j-1})) -> one decoder layer over the paged cache -> norm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0, LlamaForCausalLM)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] target embeddings of x_j
        features: torch.Tensor,  # [T, H] target (or predicted) features f_{j-1}
        positions: torch.Tensor,  # [T] j
        ctx: ForwardContext,  # the head's own one-layer KV pool
    ) -> torch.Tensor:  # [T, H] predicted f_j (the target's LM head reads it)
        """Predicted target features for each (token, previous feature) pair of the flat batch."""
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


def head_config(target_config: Any) -> Any:
    """The head's config: the target's Llama sizes with one layer."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None)
        or target_config.num_attention_heads,
        head_dim=head_dim_of(target_config),
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=rope_parameters(target_config),
        architectures=[ARCHITECTURE],
    )
    config.hidden_act = "silu"
    return config


def load_eagle_head(
    path: str | Path, dtype: torch.dtype, device: torch.device | str
) -> tuple[EagleHead, Any]:
    """Load a head checkpoint directory; return (head in eval mode, its config)."""
    from paged_llm.models.checkpoint import find_weight_files, iter_weight_files
    from paged_llm.models.loader import load_config

    config = load_config(path)
    if ARCHITECTURE not in (getattr(config, "architectures", None) or []):
        raise ValueError(
            f"{path} is not an EAGLE head (config.json architectures should be "
            f"['{ARCHITECTURE}'], got {getattr(config, 'architectures', None)})"
        )
    with torch.device("meta"):
        head = EagleHead(config)
    head = head.to(dtype=dtype).to_empty(device=device)
    load_named_weights(head, iter_weight_files(find_weight_files(Path(path))))
    return head.eval(), config


def save_eagle_head(state: dict[str, torch.Tensor], config: Any, path: str | Path) -> None:
    """Write a head checkpoint (config.json, model.safetensors) from its named parameters."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in state.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def random_eagle_head(target_dir: str | Path, path: str | Path, seed: int = 0) -> Path:
    """An untrained head for the checkpoint in ``target_dir`` (tests: drafts are poor, outputs
    must still be exact)."""
    from paged_llm.models.loader import load_config

    config = head_config(load_config(target_dir))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(config)
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.05)
    save_eagle_head(dict(head.named_parameters()), config, path)
    return Path(path)
