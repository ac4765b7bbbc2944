"""What every causal LM here shares: tied embeddings, logits, and (from models/weights.py)
weight loading. The helpers that read an HF config (head width, KV heads, sliding windows) are
models/loader.py's.

The model runner relies on exactly this interface::

    forward(input_ids [T] int64, positions [T] int64, ctx: ForwardContext) -> hidden [T, H']
    compute_logits(hidden [N, H']) -> [N, vocab] float32
    load_weights(iterable of (hf_name, tensor)) -> None

H' is the width the LM head reads (hidden_size, or word_embed_proj_dim for OPT-350m).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# load_named_weights is also read from here by the models that load their own way
from paged_llm.models.weights import CheckpointWeights, load_named_weights

__all__ = ["CausalLM", "load_named_weights"]


class CausalLM(CheckpointWeights, nn.Module):
    """Base class: subclasses build ``self.model`` and ``self.lm_head`` and then call
    :meth:`tie_weights`; module names mirror HF's so checkpoint names map one to one (the
    loading itself is ``CheckpointWeights``')."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table (the LM head shares it when embeddings are tied)."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding Parameter itself when embeddings are tied."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.get_input_embeddings().weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H'] -> [N, V]
        """Project selected hidden states onto the vocabulary, returned in float32."""
        return self.lm_head(hidden).float()
