"""KV transfer between engines (vLLM's ``kv_transfer_config``): a connector saves the KV a
producer engine computes and a consumer engine loads it instead of computing it -- disaggregated
prefill. See docs/kv_transfer.md."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from paged_llm.kv_transfer.config import KV_ROLES, KVTransferConfig, as_kv_transfer_config
from paged_llm.utils.registry import resolve

KV_CONNECTORS = {
    "SharedStorageConnector": "paged_llm.kv_transfer.shared_storage.SharedStorageConnector",
}


def checkpoint_identity(path: Path) -> str:
    """What identifies a checkpoint directory on any machine: its config (without the path it
    was loaded from) and the names and sizes of its weight files, hashed."""
    config = (
        json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    )
    config.pop("_name_or_path", None)
    files = sorted((f.name, f.stat().st_size) for f in path.iterdir()
                   if f.suffix in (".safetensors", ".bin"))  # fmt: skip
    blob = json.dumps([config, files], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def build_kv_connector(
    config: KVTransferConfig, fingerprint: dict[str, Any], rank: int = 0, world_size: int = 1
) -> Any:
    """The connector ``config`` names, for this rank of an engine whose KV ``fingerprint``
    describes (what must agree for saved KV to be reusable)."""
    cls = resolve("KV connector", config.kv_connector, KV_CONNECTORS)
    return cls(config, fingerprint, rank=rank, world_size=world_size)


__all__ = [
    "KV_CONNECTORS",
    "KV_ROLES",
    "KVTransferConfig",
    "as_kv_transfer_config",
    "build_kv_connector",
    "checkpoint_identity",
]
