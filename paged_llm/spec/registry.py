"""Speculative decoding methods by name (``speculative_config={"method": ...}``)."""

from __future__ import annotations

from typing import Any

from paged_llm.utils.registry import build

SPEC_METHODS = {
    "ngram": "paged_llm.spec.ngram.NgramDrafter",
    "draft_model": "paged_llm.spec.draft_model.DraftModelDrafter",
    "eagle": "paged_llm.spec.eagle.EagleDrafter",
}


def build_drafter(spec: dict[str, Any] | None) -> Any | None:
    """A drafter from vLLM-style ``{"method": ..., "num_speculative_tokens": k, ...}``."""
    if not spec:
        return None
    spec = dict(spec)
    if "_target_" in spec:
        return build("speculative method", spec, SPEC_METHODS)
    method = spec.pop("method", None)
    if method is None:
        method = "draft_model" if "model" in spec else "ngram"
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config needs num_speculative_tokens")
    return build("speculative method", method, SPEC_METHODS, **spec)
