"""Models that only pool (``runner="pooling"``), built from the causal LMs' decoders:

* Hugging Face's ``*ForSequenceClassification`` checkpoints (classifiers, reward models,
  cross-encoder rerankers): the decoder with a bias-free ``score`` head [num_labels, H] in place
  of the LM head, applied to the pooled hidden state of the prompt's last token, as transformers
  does (``LlamaForSequenceClassification`` scores every position and keeps the last
  non-padding one; a flat, unpadded batch has no padding to skip). The pooler
  (``pooling/pooler.py``) calls :meth:`SequenceClassifier.classify` on each pooled vector and
  applies the activation.
* Bare ``*Model`` checkpoints (``MistralModel``, ``Qwen2Model``, ...: the decoder alone, as many
  embedding models ship, e.g. e5-mistral or gte-Qwen2): no head at all; their tensor names lack
  the ``model.`` prefix, which :meth:`BareDecoder.checkpoint_tensors` adds. (Named
  ``<Arch>EmbeddingModel`` here: ``llama.LlamaModel`` is the decoder body every Llama holds.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paged_llm.distributed.sharding import shard_checkpoint
from paged_llm.models.base import load_named_weights
from paged_llm.models.gpt2 import GPT2LMHeadModel
from paged_llm.models.gpt_neox import GPTNeoXForCausalLM
from paged_llm.models.llama import LlamaForCausalLM
from paged_llm.models.llama_variants import MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from paged_llm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from paged_llm.models.opt import OPTForCausalLM


class PoolingOnly:
    """Mixin placed before a causal LM class: the same decoder without the LM head (the model
    pools, it never samples)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]  # the causal LM's decoder and head
        self.pooled_width = self.lm_head.weight.shape[1]  # H', the final hidden states' width
        del self.lm_head  # no vocabulary projection
        self.tie_word_embeddings = False

    def tie_weights(self) -> None:
        """Nothing to tie: there is no LM head."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A pooling-only model has no vocabulary logits."""
        raise RuntimeError(
            f"{type(self).__name__} has no LM head: it pools (runner='pooling'), it does not "
            "generate"
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; raise on any mismatch or missing one."""
        renamed = shard_checkpoint(self, self.checkpoint_tensors(weights))  # type: ignore
        load_named_weights(self, renamed)  # type: ignore[arg-type]


class SequenceClassifier(PoolingOnly):
    """A decoder with a ``score`` head instead of the LM head. The score head is replicated
    under tensor parallelism (it is tiny)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.num_labels = int(config.num_labels)
        self.score = nn.Linear(self.pooled_width, self.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, H'] -> [N, num_labels]
        """The score head's logits of pooled hidden states, in float32."""
        return self.score(pooled.to(self.score.weight.dtype)).float()


class BareDecoder(PoolingOnly):
    """A decoder saved without its causal LM wrapper (HF ``*Model``): tensor names without the
    ``model.`` prefix; embeddings only."""

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str | None, torch.Tensor]]:
        """The causal LM's renaming, after putting each name under ``model.``."""
        prefixed = ((n if n.startswith("model.") else "model." + n, t) for n, t in weights)
        return super().checkpoint_tensors(prefixed)  # type: ignore[misc]


def is_classifier(model: nn.Module) -> bool:
    """Whether ``model`` is a sequence classifier (it pools and classifies, never samples)."""
    return isinstance(model, SequenceClassifier)


def pools_only(model: nn.Module) -> bool:
    """Whether ``model`` has no LM head (a classifier or a bare decoder): it cannot generate."""
    return isinstance(model, PoolingOnly)


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


class GPT2ForSequenceClassification(SequenceClassifier, GPT2LMHeadModel):
    """GPT-2 decoder + score head."""


class GPTNeoXForSequenceClassification(SequenceClassifier, GPTNeoXForCausalLM):
    """GPT-NeoX / Pythia decoder + score head (e.g. Pythia reward models)."""


class LlamaEmbeddingModel(BareDecoder, LlamaForCausalLM):
    """A bare LLaMA decoder."""


class MistralEmbeddingModel(BareDecoder, MistralForCausalLM):
    """A bare Mistral decoder (e5-mistral, SFR-Embedding-Mistral)."""


class Qwen2EmbeddingModel(BareDecoder, Qwen2ForCausalLM):
    """A bare Qwen2 decoder (gte-Qwen2)."""


class Qwen3EmbeddingModel(BareDecoder, Qwen3ForCausalLM):
    """A bare Qwen3 decoder."""


class OPTEmbeddingModel(BareDecoder, OPTForCausalLM):
    """A bare OPT decoder."""
