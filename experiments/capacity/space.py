"""The search space as the sweepers read it (``hydra.sweeper.params``: ``key: choice(a,b)``),
expanded into its grid of override dicts (plain Python over Hydra's override parser)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any


def choices(params: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Each swept key's values, parsed as Hydra parses ``key=choice(...)`` / ``key=a,b``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = {}
    for key, spec in params.items():
        o = parser.parse_override(f"{key}={spec}")
        out[key] = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
    return out


def grid(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every combination of the swept values (the basic sweeper's jobs), as key -> value."""
    space = choices(params)
    return [dict(zip(space, combo)) for combo in itertools.product(*space.values())]


def apply(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved config (plain dict) with dotted-key overrides applied (a copy)."""
    import copy

    out = copy.deepcopy(dict(cfg))
    for dotted, value in overrides.items():
        node = out
        *path, last = dotted.split(".")
        for step in path:
            node = node[step]
        node[last] = value
    return out
