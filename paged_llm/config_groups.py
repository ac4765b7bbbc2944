"""The engine config groups every experiment composes (configs/engine_groups.yaml: model,
attention, policy, quant, speculative, kv_cache_dtype, scheduling, cache, scheduler) as engine
arguments, and the checks that refuse a bad combination before any work starts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def quant_spec(node: Any) -> Any:
    """The ``quantization=`` argument for a ``quant`` group node (``quant=none``: None)."""
    return dict(node) if isinstance(node, Mapping) and node else (node or None)


def speculative_spec(node: Any) -> dict[str, Any] | None:
    """The ``speculative_config`` for a ``speculative`` group node (``none``: None); a
    built-in draft or EAGLE model name becomes its checkpoint directory."""
    if not node:
        return None
    spec = dict(node)
    if spec.get("model"):
        spec["model"] = model_ref(str(spec["model"]))
    return spec


def model_ref(name: str) -> str:
    """A checkpoint directory as given, else a built-in trained model (trained on first use)."""
    if Path(name).is_dir():
        return name
    from paged_llm.models.trained import trained_model_dir

    return str(trained_model_dir(name))


def check_speculative(node: Any) -> None:
    """Build (not load) the drafter, as the server's --speculative-config check does, so an
    unknown method, a missing num_speculative_tokens or a key the method does not take fails
    before any model loads."""
    from paged_llm.spec.registry import build_drafter

    build_drafter(dict(node) if node else None)


def preflight(cfg: Mapping[str, Any], hf_config: Any) -> None:
    """Every check of the composed groups against the model's config, before any work."""
    from paged_llm.quant.preflight import check_quantization

    check_speculative(cfg.get("speculative"))
    check_quantization(quant_spec(cfg.get("quant")), hf_config)
