"""Name -> import path tables for swappable parts, so plain Python (``attention_backend="triton"``)
and Hydra configs (``_target_: paged_llm...``) select the same classes."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any


def import_target(path: str) -> Any:
    """Import ``package.module.Name`` and return ``Name``."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"'{path}' is not a dotted import path")
    return getattr(importlib.import_module(module_name), attr)


def check_import_path(path: str) -> str:
    """``pkg.module.Class`` from that or vLLM's ``pkg.module:Class``; a clear error otherwise."""
    dotted = path.replace(":", ".")
    parts = dotted.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ValueError(f"'{path}' is not an import path like 'my_pkg.models.MyForCausalLM'")
    return dotted


def resolve(kind: str, name: str, table: dict[str, str]) -> Any:
    """Look ``name`` up in ``table`` (or accept a dotted path) and import it."""
    if name in table:
        return import_target(table[name])
    if "." in name:
        return import_target(name)
    raise ValueError(f"unknown {kind} '{name}'; choose one of {sorted(table)}")


class UnsupportedOptions(ValueError):
    """A swappable part was given options its constructor does not take."""


def _construct(kind: str, name: str, cls: Any, params: dict[str, Any]) -> Any:
    """``cls(**params)``, with options it does not take reported as a ValueError naming the
    part (checked against its signature first, so a TypeError from inside it stays one)."""
    try:
        inspect.signature(cls).bind(**params)
    except TypeError as err:
        raise UnsupportedOptions(f"{kind} '{name}' does not take these options: {err}") from None
    except ValueError:
        pass  # no inspectable signature: let the call decide
    return cls(**params)


def target_class(kind: str, spec: Any, table: dict[str, str]) -> Any:
    """The class ``build`` would construct for ``spec`` (imported, not built): for a name or
    dotted path, a ``{_target_: ...}`` mapping, or an object already built (its type)."""
    if isinstance(spec, str):
        return resolve(kind, spec, table)
    if isinstance(spec, Mapping):
        if "_target_" not in spec:
            raise ValueError(f"{kind} config needs a '_target_' key, got {dict(spec)}")
        return import_target(spec["_target_"])
    return type(spec)


def build(kind: str, spec: Any, table: dict[str, str], **kwargs: Any) -> Any:
    """Build a swappable part from a name, a dotted path, a ``{_target_: ...}`` mapping (as
    Hydra configs write it) or return ``spec`` itself when it is already an object."""
    if isinstance(spec, str):
        return _construct(kind, spec, target_class(kind, spec, table), kwargs)
    if isinstance(spec, Mapping):
        cls = target_class(kind, spec, table)
        params = {k: v for k, v in spec.items() if k != "_target_"}
        return _construct(kind, spec["_target_"], cls, {**params, **kwargs})
    return spec
