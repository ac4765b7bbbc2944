"""vLLM's ``KVTransferConfig``: which connector moves KV between engines, and in which
direction (no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """A KV connector and this engine's role: a producer saves the KV of the prompts it
    computes, a consumer loads what it finds instead of computing it, ``kv_both`` does both."""

    kv_connector: str | None = None  # a name in KV_CONNECTORS or a dotted path
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.kv_connector:
            raise ValueError(
                "kv_transfer_config needs 'kv_connector' (e.g. SharedStorageConnector)"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"unknown kv_role '{self.kv_role}'; choose one of {list(KV_ROLES)}")
        if not isinstance(self.kv_connector_extra_config, Mapping):
            raise ValueError("kv_connector_extra_config must be a mapping")
        self.kv_connector_extra_config = dict(self.kv_connector_extra_config)

    @property
    def is_kv_producer(self) -> bool:
        """True when this engine saves KV for others."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """True when this engine loads KV that others saved."""
        return self.kv_role in ("kv_consumer", "kv_both")


def as_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """A ``KVTransferConfig`` from one, from a mapping of its fields (Python, JSON on the
    command line, a Hydra node), or None; unknown keys are refused."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"kv_transfer_config must be a KVTransferConfig or a mapping, got {value!r}"
        )
    known = {f.name for f in fields(KVTransferConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown kv_transfer_config key(s) {unknown}; known: {sorted(known)}")
    return KVTransferConfig(**dict(value.items()))
