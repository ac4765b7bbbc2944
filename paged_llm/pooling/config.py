"""How a pooling model pools: vLLM's ``PoolerConfig``, filled from the checkpoint's
sentence-transformers files where it has them.

A sentence-transformers checkpoint says how it pools in ``modules.json`` (a ``Pooling`` module
whose ``config.json`` names the mode, an optional ``Normalize`` module). Without them a decoder
embeds with its last token, L2-normalised (vLLM's default for decoder models run as embedders).
Fields given in ``LLM(..., pooler_config={...})`` win over the checkpoint's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from paged_llm.pooling.methods import POOLING_METHODS

# sentence-transformers' Pooling config flag -> our pooling type
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")  # fmt: skip
_ST = "sentence_transformers.models."


@dataclass
class PoolerConfig:
    """``pooling_type``: LAST | MEAN | CLS | ALL; ``normalize``: L2-normalise each output
    (PoolingParams.normalize overrides it per request). None: the checkpoint's (or default)."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_METHODS:
                raise ValueError(
                    f"unknown pooling_type '{self.pooling_type}'; choose one of "
                    f"{sorted(POOLING_METHODS)}"
                )
        if self.normalize not in (None, True, False):
            raise ValueError(f"normalize must be None, True or False, got {self.normalize!r}")


def as_pooler_config(value: Any) -> PoolerConfig:
    """A PoolerConfig from None, a dict (Hydra or JSON) or a PoolerConfig."""
    if value is None:
        return PoolerConfig()
    if isinstance(value, PoolerConfig):
        return value
    value = dict(value)
    unknown = set(value) - {f.name for f in fields(PoolerConfig)}
    if unknown:
        raise ValueError(f"unknown pooler_config field(s) {sorted(unknown)}")
    return PoolerConfig(**value)


def checkpoint_pooler_config(model_dir: Path | None) -> PoolerConfig:
    """What the checkpoint's sentence-transformers files say (empty fields where they say
    nothing, or where there are none). Raises for modules whose effect is not implemented."""
    modules_file = model_dir / "modules.json" if model_dir is not None else None
    if modules_file is None or not modules_file.is_file():
        return PoolerConfig()
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    unsupported = [t for t in types
                   if t.startswith(_ST) and t.removeprefix(_ST) not in
                   ("Transformer", "Pooling", "Normalize")]  # fmt: skip
    if unsupported:
        raise ValueError(
            f"{modules_file} has sentence-transformers modules this engine does not apply: "
            f"{unsupported}"
        )
    pooling_type = None
    for module in modules:
        if module.get("type") == _ST + "Pooling":
            pooling_type = _st_pooling_type(model_dir / module.get("path", ""))
    return PoolerConfig(pooling_type=pooling_type, normalize=(_ST + "Normalize") in types)


def _st_pooling_type(pooling_dir: Path) -> str | None:
    """The pooling type a sentence-transformers Pooling module's config.json selects."""
    path = pooling_dir / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    chosen = [mode for flag, mode in _ST_MODES.items() if cfg.get(flag)]
    odd = [flag for flag in _ST_UNSUPPORTED if cfg.get(flag)]
    if odd or len(chosen) > 1:
        raise ValueError(f"{path}: pooling {odd + chosen} is not supported (one of "
                         f"{sorted(_ST_MODES)} only)")  # fmt: skip
    return chosen[0] if chosen else None


def resolve_pooler_config(requested: Any, model_dir: Path | None) -> PoolerConfig:
    """The fields asked for, else the checkpoint's, else LAST and normalised."""
    asked, saved = as_pooler_config(requested), checkpoint_pooler_config(model_dir)
    pick = lambda name, default: next(  # noqa: E731 - the first field that is set
        (v for v in (getattr(asked, name), getattr(saved, name)) if v is not None), default
    )
    return PoolerConfig(
        pooling_type=pick("pooling_type", "LAST"), normalize=pick("normalize", True)
    )
