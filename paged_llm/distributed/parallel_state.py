"""Which tensor-parallel group a model is built for, and the two collectives its layers call.

Models read :func:`current_group` while they are constructed (the engine wraps model loading in
:func:`building_for`); outside that, and always when ``tensor_parallel_size == 1``, the group is
the single-rank default and nothing here touches torch.distributed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel world (the default process group)."""

    rank: int = 0
    size: int = 1
    # vLLM's enable_expert_parallel: mixture-of-experts layers give each rank whole experts
    # (E / size of them) instead of a 1 / size slice of every expert (layers/moe.py)
    expert_parallel: bool = False

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and the sampler; other ranks only run the model."""
        return self.rank == 0


SINGLE = TPGroup()
# Set in worker processes the engine spawns itself (as opposed to ranks started by torchrun).
SPAWNED_ENV = "PAGED_LLM_TP_SPAWNED"
_building: TPGroup = SINGLE


def current_group() -> TPGroup:
    """The group that models constructed right now are split across (``SINGLE`` by default)."""
    return _building


@contextlib.contextmanager
def building_for(group: TPGroup | None) -> Iterator[None]:
    """Construct models inside this block split across ``group`` (None: unsplit)."""
    global _building
    previous, _building = _building, group or SINGLE
    try:
        yield
    finally:
        _building = previous


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over every rank, in place; return it."""
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` [R, ...] concatenated in rank order, on every rank: [size * R, ...]."""
    import torch.distributed as dist

    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def gather_to_driver(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` [N, V/size] along the last dim on rank 0: [N, V].

    Other ranks get their own ``x`` back (they never sample, so they discard it).
    """
    import torch.distributed as dist

    x = x.contiguous()
    if not group.is_driver:
        dist.gather(x, None, dst=0)
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1)
