"""Finding and reading HF checkpoint files: safetensors or PyTorch .bin, single or sharded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def find_weight_files(model_dir: Path) -> list[Path]:
    """Checkpoint files to read, preferring safetensors; sharded checkpoints follow their index."""
    for index_name, pattern in (
        (SAFETENSORS_INDEX, "*.safetensors"),
        (BIN_INDEX, "pytorch_model*.bin"),
    ):
        index = model_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
            return [model_dir / s for s in shards]
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(
        f"no weights found in {model_dir}: expected model.safetensors, sharded safetensors with "
        f"{SAFETENSORS_INDEX}, pytorch_model.bin, or sharded .bin files with {BIN_INDEX}"
    )


def iter_weight_files(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every file, one file at a time."""
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        else:
            # weights_only: a .bin is a pickle; never execute arbitrary code from a checkpoint.
            yield from _torch_load(path).items()


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    """torch.load a state dict, memory-mapped when the file format allows it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        # Checkpoints from torch < 1.6 use the legacy (non-zip) format, which cannot be mmapped.
        return torch.load(path, map_location="cpu", weights_only=True)
