"""vLLM's ``SharedStorageConnector``: KV blocks as safetensors files in a directory that a
prefill (producer) engine and a decode (consumer) engine both reach -- a local disk, a network
file system, a RAM disk. It is the simplest way to disaggregate prefill from decode, and the
reference for a faster connector (a network transfer) behind the same four methods.

Files are named by a content key per full block: SHA-256 chained over the previous block's key
and this block's token ids, under a directory named by what makes KV comparable (model, dtypes,
block size, tensor-parallel size, the weights' version). Each tensor-parallel rank writes its
own file for its KV heads. A file is written under a temporary name and renamed, so a reader
never sees half of one.

Scheduler side (plain Python): ``block_keys`` and ``contains``. Worker side (torch, imported on
first use): ``save`` after the forward pass that wrote the blocks, ``load`` before the forward
pass that reads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paged_llm.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

KEY_BITS = 128  # of SHA-256; keys >= 2**127, so they never equal a block id in a (key, block) op


def chain_keys(
    known: list[int], tokens: Sequence[int], block_size: int, num_blocks: int, salt: str = ""
) -> list[int]:
    """Extend ``known`` (the keys of the first blocks) to ``num_blocks`` keys; each hashes the
    previous key, ``salt`` and its block's token ids, so equal keys mean equal prefixes."""
    while len(known) < num_blocks:
        i = len(known)
        prev = known[-1].to_bytes(KEY_BITS // 8, "big") if known else salt.encode()
        block = ",".join(map(str, tokens[i * block_size : (i + 1) * block_size])).encode()
        digest = hashlib.sha256(prev + b"|" + block).digest()[: KEY_BITS // 8]
        known.append(int.from_bytes(digest, "big") | (1 << (KEY_BITS - 1)))
    return known


class SharedStorageConnector:
    """Saves and loads full KV blocks as files under ``shared_storage_path``."""

    name = "SharedStorageConnector"

    def __init__(
        self,
        config: KVTransferConfig,
        fingerprint: dict[str, Any],
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        extra = dict(config.kv_connector_extra_config)
        base = Path(extra.pop("shared_storage_path", "local_storage"))
        if extra:
            raise ValueError(
                f"{self.name} does not take kv_connector_extra_config {sorted(extra)}; "
                "it takes shared_storage_path"
            )
        self.base = base
        self.fingerprint = dict(fingerprint)
        self.can_save, self.can_load = config.is_kv_producer, config.is_kv_consumer
        self.rank, self.world_size = rank, world_size
        self.weights_version = 0
        self.num_saved = 0  # blocks this rank wrote
        self.num_loaded = 0  # blocks this rank read instead of computing them
        self.bytes_saved = self.bytes_loaded = 0  # file bytes
        self.seconds_saving = self.seconds_loading = 0.0  # wall time inside save / load
        self.save_failures = 0  # blocks that could not be written (skipped)

    @property
    def root(self) -> Path:
        """This model's directory: KV from different weights or layouts never mixes."""
        ident = json.dumps({**self.fingerprint, "weights_version": self.weights_version},
                           sort_keys=True)  # fmt: skip
        return self.base / hashlib.sha256(ident.encode()).hexdigest()[:16]

    def new_weights(self) -> None:
        """The weights changed (``load_weights``): KV saved before no longer matches."""
        self.weights_version += 1

    def _path(self, key: int, rank: int) -> Path:
        return self.root / f"{key:032x}.rank{rank}.safetensors"

    # ---- scheduler side (no torch) -----------------------------------------------------------
    def block_keys(
        self, known: list[int], tokens: Sequence[int], block_size: int, num_blocks: int,
        salt: str = "",
    ) -> list[int]:  # fmt: skip
        """The content keys of the first ``num_blocks`` full blocks (see ``chain_keys``)."""
        return chain_keys(known, tokens, block_size, num_blocks, salt)

    def contains(self, key: int) -> bool:
        """True when every rank's file of this block is in the store."""
        return all(self._path(key, r).is_file() for r in range(self.world_size))

    # ---- worker side (torch) -----------------------------------------------------------------
    def save(self, pools: dict[str, list[tuple[Any, Any]]], pairs: list[tuple[int, int]]) -> None:
        """Write device block ``block`` of every pool to the file of ``key``, for each (block,
        key) of ``pairs``. ``pools`` names lists of per-layer (K, V) pools ("kv"; "scales" for a
        quantized cache); each list is stored as one [layers, 2, ...] tensor, so a file is one
        contiguous write and one read. A block that cannot be written (a full disk, a store
        that went away) is skipped with a warning: the store lacks it, the step goes on."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        for block, key in pairs:
            path = self._path(key, self.rank)
            tensors = {name: _stack_block(layers, block).cpu()
                       for name, layers in pools.items() if layers}  # fmt: skip
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(tmp))
                os.replace(tmp, path)  # atomic: a reader sees the whole file or none
                self.bytes_saved += path.stat().st_size
            except OSError as err:
                self._save_failed(tmp, err)
                continue
            self.num_saved += 1
        self.seconds_saving += time.perf_counter() - start

    def _save_failed(self, tmp: Path, err: OSError) -> None:
        """Count a block that could not be saved, warn on the first, drop its partial file."""
        self.save_failures += 1
        if self.save_failures == 1:
            logger.warning("KV connector: cannot save under %s (%s); blocks that cannot be "
                           "saved are skipped", self.base, err)  # fmt: skip
        with contextlib.suppress(OSError):
            tmp.unlink()

    def load(self, pools: dict[str, list[tuple[Any, Any]]], pairs: list[tuple[int, int]]) -> None:
        """Fill device block ``block`` of every pool from the file of ``key``, for each (key,
        block) of ``pairs``."""
        from safetensors.torch import load_file

        start = time.perf_counter()
        for key, block in pairs:
            path = self._path(key, self.rank)
            try:
                tensors = load_file(str(path))
            except FileNotFoundError:
                raise RuntimeError(
                    f"KV block file {path} disappeared between lookup and load; do not delete "
                    "a store engines are reading"
                ) from None
            for name, layers in pools.items():
                if not layers:
                    continue
                src = tensors.get(name)
                want = (len(layers), 2, *layers[0][0][block].shape)
                if src is None or tuple(src.shape) != want or src.dtype != layers[0][0].dtype:
                    raise ValueError(f"KV block file {path} does not match this engine's "
                                     f"'{name}' pools")  # fmt: skip
                for i, (k, v) in enumerate(layers):
                    k[block].copy_(src[i, 0])
                    v[block].copy_(src[i, 1])
            self.num_loaded += 1
            self.bytes_loaded += path.stat().st_size
        self.seconds_loading += time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        """Blocks, bytes and seconds this rank saved and loaded."""
        return {
            "blocks_saved": self.num_saved, "blocks_loaded": self.num_loaded,
            "bytes_saved": self.bytes_saved, "bytes_loaded": self.bytes_loaded,
            "seconds_saving": self.seconds_saving, "seconds_loading": self.seconds_loading,
            "save_failures": self.save_failures,
        }  # fmt: skip


def _stack_block(layers: list[tuple[Any, Any]], block: int) -> Any:
    """Block ``block`` of per-layer (K, V) pools as one [layers, 2, ...] tensor."""
    import torch

    return torch.stack([torch.stack((k[block], v[block])) for k, v in layers])
