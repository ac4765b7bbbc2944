"""A sequence classifier's last step, applied by the pooler to each pooled vector: the model's
score head gives label logits, then the activation turns them into probabilities (vLLM's
``ClassifierPooler``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ClassifierHead:
    """``score``: [N, H] pooled -> [N, num_labels] float32 logits (the model's score head).
    ``sigmoid``: one independent probability per label (a one-label model, a reward model or
    cross-encoder, or ``problem_type`` multi_label_classification) instead of a softmax."""

    score: Callable[[torch.Tensor], torch.Tensor]
    num_labels: int
    sigmoid: bool

    def __call__(self, pooled: torch.Tensor, activation: bool = True) -> torch.Tensor:
        """[H] pooled hidden state -> [num_labels] probabilities (logits without activation)."""
        logits = self.score(pooled[None])[0]
        if not activation:
            return logits
        return torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)


def classifier_head(model: Any, hf_config: Any) -> ClassifierHead | None:
    """The head of a sequence-classification model; None for any other model."""
    from paged_llm.models.classification import is_classifier

    if not is_classifier(model):
        return None
    multi_label = getattr(hf_config, "problem_type", None) == "multi_label_classification"
    return ClassifierHead(model.classify, model.num_labels, model.num_labels == 1 or multi_label)
