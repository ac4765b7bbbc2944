"""Host lists of ints as tensors, fast: a step's inputs are built from Python lists every step."""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch


def int_tensor(values: Sequence[int]) -> torch.Tensor:  # [len(values)] int64, on the CPU
    """A CPU int64 tensor of a flat list of ints, through ``array.array``: about 4x faster than
    ``torch.tensor`` (a batch-256 decode step's 16,000 input ints: 0.22 against 0.83 ms on the
    project's CPU machine; experiments/bench_step_inputs.py, docs/results/step_inputs-*.json),
    which matters once a GPU step takes milliseconds."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on ``device``, without the host waiting for the device's queue: on a
    GPU through pinned memory and a non-blocking copy (a copy from pageable memory waits for
    the stream, which under async scheduling is the previous step's whole forward; PyTorch's
    pinned-memory cache keeps the source until the copy ran). The tensor itself on the CPU."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def padded_int_rows(rows: Sequence[Sequence[int]], width: int = 0) -> torch.Tensor:
    """Ragged rows of ints as one zero-padded CPU int64 tensor [len(rows), W], W the widest row
    or ``width`` if wider. Rows given as ``array.array("q")`` (``runner.batch.BlockTableRows``)
    are copied by memcpy, not int by int: a step's block tables are 256 sequences x ~60
    blocks, every step."""
    w = max([width, *(len(r) for r in rows)])
    zeros = array.array("q", bytes(8 * w))
    flat = array.array("q")
    for r in rows:
        flat.extend(r)
        flat.extend(zeros[: w - len(r)])
    if not flat:
        return torch.zeros(len(rows), w, dtype=torch.int64)
    return torch.frombuffer(flat, dtype=torch.int64).view(len(rows), w)
