"""PoolingParams with vLLM's names: how one embedding / pooling request is post-processed."""

from __future__ import annotations

from dataclasses import dataclass

from paged_llm.utils.checks import is_int


@dataclass
class PoolingParams:
    """Per-request options of ``LLM.embed`` / ``LLM.encode`` (vLLM's fields).

    ``dimensions``: keep the first d features, then normalise (Matryoshka embeddings; only for
    models whose config says they were trained for it). ``normalize``: L2-normalise the result
    (None: the model's pooler default, see ``PoolerConfig``). ``truncate_prompt_tokens``: keep
    the prompt's last k tokens.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        if self.normalize not in (None, True, False):
            raise ValueError(f"normalize must be None, True or False, got {self.normalize!r}")

    def clone(self) -> PoolingParams:
        """A copy (vLLM's method)."""
        return PoolingParams(self.dimensions, self.normalize, self.truncate_prompt_tokens)
