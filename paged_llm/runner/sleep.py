"""Sleep mode (vLLM's ``sleep`` / ``wake_up``): free a rank's device memory between uses of the
engine, e.g. while an RL trainer needs the GPU, and get it back without rebuilding the engine.

Memory is tagged as vLLM tags it: ``weights`` and ``kv_cache``. A sleep level says what happens
to each:

* level 1: weights are offloaded (copied to CPU memory, then freed on the device), the KV cache
  is discarded (its content is forgotten);
* level 2: the weights that ``load_weights`` can write (the model's parameters) are discarded
  too; everything else of the ``weights`` tag (buffers such as rotary tables and quantized
  weights, LoRA slots, a draft model) is offloaded as at level 1.

Freeing keeps every tensor object: only its storage is resized to zero bytes, and waking
resizes it back (FSDP frees parameters the same way). So the model, the attention backend and
the runner keep their references and nothing is rebuilt. A woken storage gets its CPU copy
back, or zeros when its content was discarded. On a CPU device, "offloading" would copy host
memory to host memory, so offloaded tensors are simply left in place there.

On CUDA, a freed storage goes back to PyTorch's caching allocator, and ``empty_cache()`` hands
the driver only segments with nothing live in them. In a process whose first CUDA user is the
engine, that is all of the engine's weights and KV cache (H200, 2026-12-04: 1.58 of 1.61 GiB).
But free space the allocator cached before the engine was built, inside a segment that a live
tensor pins (cuBLAS keeps its workspace for the life of the process), is reused by the engine
and can never be handed back: there a sleep handed back 0.57 of 1.5 GiB. Setting
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before the process first touches CUDA
avoided it (the same probe then handed back everything). So while a sleep-mode engine
allocates what a sleep frees (at start-up and in ``wake_up``), ``HeldFreeSpace`` puts
placeholder tensors over that pinned free space, and the engine's tensors land in segments of
their own; the placeholders are freed afterwards. Measured on the H200 (run 12,
paper_repro/gpu_results.md): after 1.97 GiB of pinned free space from earlier sections of the
GPU check, a sleep handed back 1.58 of the engine's 1.61 GiB (before the placeholders: 0.006).
The engine warns when pinned free space remains that the placeholders could not cover
(``pinned_cache_bytes``). Each sleep reports what the driver got back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

SLEEP_TAGS = ("weights", "kv_cache")
SLEEP_LEVELS = (1, 2)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:  # [nbytes] uint8 view
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Released:
    """One freed storage: its size, and its content on the CPU when kept (None: discarded)."""

    storage: torch.UntypedStorage
    nbytes: int
    backup: torch.Tensor | None


@dataclass
class SleepingMemory:
    """The storages of one tag freed by a sleep; ``restore`` brings them back."""

    released: list[_Released] = field(default_factory=list)

    @classmethod
    def release(
        cls,
        keep: Iterable[torch.Tensor],
        discard: Iterable[torch.Tensor],
        offload_host: bool = False,
    ) -> SleepingMemory:
        """Free the storages of ``keep`` (after a CPU copy) and of ``discard`` (content
        forgotten); a storage shared by both is kept. Kept CPU storages stay in place unless
        ``offload_host`` (which tests use to run the copy path on a CPU)."""
        kept = _unique_storages(keep)
        kept_keys = {_key(s) for s in kept}
        discarded = [s for s in _unique_storages(discard) if _key(s) not in kept_keys]
        out = cls()
        pin = torch.cuda.is_available()
        for storage, is_kept in [(s, True) for s in kept] + [(s, False) for s in discarded]:
            if is_kept and storage.device.type == "cpu" and not offload_host:
                continue
            backup = None
            if is_kept:
                backup = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                backup.copy_(_as_bytes(storage))
            out.released.append(_Released(storage, storage.nbytes(), backup))
            storage.resize_(0)
        return out

    @property
    def freed_bytes(self) -> int:
        """Device (or, on a CPU device, host) bytes this sleep freed."""
        return sum(r.nbytes for r in self.released)

    @property
    def offloaded_bytes(self) -> int:
        """Of those, the bytes copied to CPU memory to be restored."""
        return sum(r.nbytes for r in self.released if r.backup is not None)

    def restore(self) -> None:
        """Re-create every freed storage at its old size: the CPU copy, or zeros."""
        for r in self.released:
            r.storage.resize_(r.nbytes)
            data = _as_bytes(r.storage)
            if r.backup is None:
                data.zero_()
            else:
                data.copy_(r.backup)
        self.released = []


def _key(storage: torch.UntypedStorage) -> tuple[str, int]:
    return (str(storage.device), storage.data_ptr())


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct storage once (tied weights and views share one), in first-seen order."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen.setdefault(_key(storage), storage)
    return list(seen.values())


@dataclass
class RankMemory:
    """One rank's device tensors by what a sleep does to them."""

    parameters: list[torch.Tensor]  # load_weights writes these: discarded at level 2
    other_weights: list[torch.Tensor]  # buffers, LoRA slots, a draft model: always offloaded
    kv_cache: list[torch.Tensor]  # pools and their scales: always discarded


@dataclass
class SleepReport:
    """What one rank's sleep did, in bytes."""

    freed: int = 0  # device memory released
    offloaded: int = 0  # of it, copied to CPU memory (weights at level 1, buffers at 2)
    returned: int | None = None  # CUDA: of the device's memory, how much the driver got back


class Sleeper:
    """Puts one rank's memory to sleep by level and wakes it by tag."""

    def __init__(self) -> None:
        self.asleep: dict[str, SleepingMemory] = {}

    def sleep(self, level: int, memory: RankMemory) -> SleepReport:
        """Free the weights and the KV cache as ``level`` says (see the module docstring)."""
        check_level(level)
        if self.asleep:
            raise ValueError(f"already asleep ({sorted(self.asleep)}); wake_up() first")
        if level == 1:
            weights = SleepingMemory.release(memory.parameters + memory.other_weights, [])
        else:
            weights = SleepingMemory.release(memory.other_weights, memory.parameters)
        self.asleep = {"weights": weights, "kv_cache": SleepingMemory.release([], memory.kv_cache)}
        parts = self.asleep.values()
        return SleepReport(sum(p.freed_bytes for p in parts), sum(p.offloaded_bytes for p in parts))

    def bytes_to_restore(self, tags: Iterable[str]) -> int:
        """What waking these tags will allocate."""
        return sum(r.nbytes for t in tags if t in self.asleep for r in self.asleep[t].released)

    def wake_up(self, tags: Iterable[str]) -> None:
        """Restore the memory of these tags (those already awake are skipped)."""
        for tag in check_tags(tags):
            memory = self.asleep.pop(tag, None)
            if memory is not None:
                memory.restore()


def trim_host_heap() -> bool:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``): glibc keeps freed
    blocks below its mmap threshold (which grows to 32 MiB) for reuse, so without this a CPU
    sleep frees the large tensors only. False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


def pinned_cache_bytes(device: torch.device) -> int:
    """CUDA memory the caching allocator keeps free inside segments that live tensors also use
    (after emptying its cache): space an engine built now may take, which no sleep can hand
    back to the driver. 0 off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def free_blocks_to_hold(segments: list[dict[str, Any]], stream: int) -> list[int]:
    """Sizes of the free blocks that ``HeldFreeSpace`` covers, from a memory snapshot's
    segments taken after ``empty_cache()`` (so every segment left has something live in it):
    those of the default pool's large, non-expandable segments on ``stream``. The 2 MiB
    small-pool segments hold too little to matter, and expandable ones unmap their free pages."""
    sizes = []
    for seg in segments:
        if (
            seg.get("is_expandable")
            or seg.get("segment_type") != "large"
            or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
            or seg.get("stream") != stream
        ):
            continue
        sizes += [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
    return sizes


def hold_blocks(
    sizes: list[int], allocate: Any, reserved_bytes: Any
) -> tuple[list[torch.Tensor], bool]:
    """One placeholder per size, kept only where it took space already reserved (a hole in a
    pinned segment); one that needed a new segment is dropped at once. Returns the kept ones
    and whether any was dropped that way (its segment is then cached, to be emptied)."""
    kept, grew = [], False
    for n in sizes:
        before = reserved_bytes()
        try:
            placeholder = allocate(n)
        except torch.OutOfMemoryError:
            continue
        if reserved_bytes() > before:
            grew = True
            del placeholder
            continue
        kept.append(placeholder)
    return kept, grew


class HeldFreeSpace:
    """Placeholders over the caching allocator's free space inside segments that live tensors
    pin (see the module docstring), held while an engine allocates what a sleep should free.
    Each placeholder asks for a free block's exact size, so best-fit hands it that block. A
    no-op off CUDA or before CUDA is used."""

    def __init__(self, device: torch.device) -> None:
        self.tensors: list[torch.Tensor] = []
        if device.type != "cuda" or not torch.cuda.is_initialized():
            return
        if torch.cuda.memory.get_allocator_backend() != "native":  # cudaMallocAsync: no segments
            return
        gc.collect()  # tensors in reference cycles would pin segments until the collector runs
        torch.cuda.empty_cache()
        index = device.index if device.index is not None else torch.cuda.current_device()
        segments = [s for s in torch.cuda.memory_snapshot() if s.get("device") == index]
        stream = torch.cuda.current_stream(device).cuda_stream
        self.tensors, grew = hold_blocks(
            free_blocks_to_hold(segments, stream),
            lambda n: torch.empty(n, dtype=torch.uint8, device=device),
            lambda: torch.cuda.memory_reserved(device),
        )
        if grew:
            torch.cuda.empty_cache()

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() for t in self.tensors)

    def release(self) -> None:
        """Free the placeholders (their space goes back to the allocator's cache)."""
        self.tensors = []


def device_free_bytes(device: torch.device) -> int:
    """Free memory the CUDA driver reports for ``device`` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def check_level(level: int) -> None:
    """Raise ValueError unless ``level`` is one of SLEEP_LEVELS (an int, not a bool)."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")


def check_tags(tags: Iterable[str] | None) -> list[str]:
    """The tags to wake (None: all), each one of SLEEP_TAGS."""
    if tags is None:
        return list(SLEEP_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags)
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"unknown sleep tag(s) {unknown}; choose from {list(SLEEP_TAGS)}")
    return tags
