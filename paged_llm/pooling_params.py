"""PoolingParams with vLLM's names: how one embedding / pooling request is post-processed."""

from __future__ import annotations

from dataclasses import dataclass, replace

from paged_llm.utils.checks import is_int


@dataclass
class PoolingParams:
    """Per-request options of ``LLM.embed`` / ``LLM.encode`` (vLLM's fields).

    ``dimensions``: keep the first d features, then normalise (Matryoshka embeddings; only for
    models whose config says they were trained for it). ``normalize``: L2-normalise the result
    (None: the model's pooler default, see ``PoolerConfig``). ``truncate_prompt_tokens``: keep
    the prompt's last k tokens. ``activation``: for a classifier, turn its label logits into
    probabilities (softmax, or sigmoid for one label or multi-label models); False returns the
    raw logits (None: True).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        for name in ("normalize", "activation"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be None, True or False, got {getattr(self, name)!r}")

    def clone(self) -> PoolingParams:
        """A copy (vLLM's method)."""
        return replace(self)
