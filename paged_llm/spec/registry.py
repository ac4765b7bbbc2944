"""Speculative decoding methods by name (``speculative_config={"method": ...}``)."""

from __future__ import annotations

from typing import Any

from paged_llm.spec.base import Drafter
from paged_llm.utils.registry import build

SPEC_METHODS = {
    "ngram": "paged_llm.spec.ngram.NgramDrafter",
    "draft_model": "paged_llm.spec.draft_model.DraftModelDrafter",
    "eagle": "paged_llm.spec.eagle.EagleDrafter",
}


# Keys of speculative_config that the engine reads; the drafter never sees them.
ENGINE_KEYS = ("disable_by_batch_size",)


def disable_by_batch_size(spec: dict[str, Any] | None) -> int | None:
    """vLLM's ``disable_by_batch_size``: no drafts in a step that starts with at least this
    many running requests (None: always draft)."""
    value = (spec or {}).get("disable_by_batch_size")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"disable_by_batch_size must be an integer >= 1, got {value!r}")
    return value


def build_drafter(spec: dict[str, Any] | None) -> Drafter | None:
    """A drafter from vLLM-style ``{"method": ..., "num_speculative_tokens": k, ...}``, or
    ``{"_target_": "pkg.MyDrafter", ...}`` for a ``spec.base.Drafter`` of your own."""
    if not spec:
        return None
    disable_by_batch_size(spec)  # checked here too, so a bad value fails before any loading
    spec = {k: v for k, v in spec.items() if k not in ENGINE_KEYS}
    if "_target_" in spec:
        drafter = build("speculative method", spec, SPEC_METHODS)
    else:
        method = spec.pop("method", None)
        if method is None:
            method = "draft_model" if "model" in spec else "ngram"
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs num_speculative_tokens")
        drafter = build("speculative method", method, SPEC_METHODS, **spec)
    if not isinstance(drafter, Drafter):
        raise ValueError(
            f"speculative drafter {type(drafter).__name__} must subclass paged_llm.spec.base."
            "Drafter (the hooks the engine calls: docs/speculative.md)"
        )
    return drafter
