"""Sequence classification models: Hugging Face's ``*ForSequenceClassification`` checkpoints
(classifiers, reward models, cross-encoder rerankers) run as pooling models.

Each is the decoder of the matching causal LM with a bias-free ``score`` head
[num_labels, H] in place of the LM head, applied to the pooled hidden state of the prompt's
last token, as transformers does (``LlamaForSequenceClassification`` scores every position and
keeps the last non-padding one; a flat, unpadded batch has no padding to skip). The pooler
(``pooling/pooler.py``) calls :meth:`SequenceClassifier.classify` on each pooled vector and
applies the activation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paged_llm.distributed.sharding import shard_checkpoint
from paged_llm.models.base import load_named_weights
from paged_llm.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from paged_llm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from paged_llm.models.opt import OPTForCausalLM


class SequenceClassifier:
    """Mixin placed before a causal LM class: same decoder, ``score`` head instead of the LM
    head. The score head is replicated under tensor parallelism (it is tiny)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]  # the causal LM's decoder and head
        in_features = self.lm_head.weight.shape[1]  # H', the width of the final hidden states
        del self.lm_head  # pooled, never sampled: no vocabulary projection
        self.tie_word_embeddings = False
        self.num_labels = int(config.num_labels)
        self.score = nn.Linear(in_features, self.num_labels, bias=False)

    def tie_weights(self) -> None:
        """Nothing to tie: there is no LM head."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A classifier has no vocabulary logits."""
        raise RuntimeError(
            f"{type(self).__name__} is a classification model: it pools and classifies "
            "(runner='pooling', LLM.classify), it does not generate"
        )

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, H'] -> [N, num_labels]
        """The score head's logits of pooled hidden states, in float32."""
        return self.score(pooled.to(self.score.weight.dtype)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (``model.*`` and ``score.weight``); raise on any mismatch."""
        renamed = shard_checkpoint(self, self.checkpoint_tensors(weights))  # type: ignore
        load_named_weights(self, renamed)  # type: ignore[arg-type]


def is_classifier(model: nn.Module) -> bool:
    """Whether ``model`` is a sequence classifier (it pools and classifies, never samples)."""
    return isinstance(model, SequenceClassifier)


class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    """LLaMA decoder + score head (reward models such as Skywork-Reward-Llama)."""


class MistralForSequenceClassification(SequenceClassifier, MistralForCausalLM):
    """Mistral decoder + score head."""


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    """Qwen2 decoder + score head (Qwen2.5 reward / classifier checkpoints)."""


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    """Qwen3 decoder + score head (the sequence-classification form of Qwen3-Reranker)."""


class MixtralForSequenceClassification(SequenceClassifier, MixtralForCausalLM):
    """Mixtral decoder + score head."""


class Qwen2MoeForSequenceClassification(SequenceClassifier, Qwen2MoeForCausalLM):
    """Qwen2-MoE decoder + score head."""


class Qwen3MoeForSequenceClassification(SequenceClassifier, Qwen3MoeForCausalLM):
    """Qwen3-MoE decoder + score head."""


class OPTForSequenceClassification(SequenceClassifier, OPTForCausalLM):
    """OPT decoder + score head (on the projected-out width where OPT-350m projects)."""
