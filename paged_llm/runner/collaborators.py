"""What the model runner asks of the parts it is built with, as typed Protocols: each is
optional (None when its feature is off) and chosen at construction, so the step never asks
which features are on. The drafter's interface is ``spec.base.Drafter``; the attention
backend's is ``attention.base.AttentionBackend``."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from paged_llm.core.scheduler import ScheduledRequest
    from paged_llm.runner.sampler import PendingTokens, SampleResult

KVPools = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), as runner.kv_cache's


class TensorParallelStep(Protocol):
    """Rank 0 of a tensor-parallel world (distributed.launch.TensorParallel): every other rank
    runs the step rank 0 runs inside ``step``."""

    def step(self, block_ops: list, batch: Any) -> AbstractContextManager[None]:
        """Send this step to the other ranks; the local step runs inside the block."""
        ...


class LoRAAdapters(Protocol):
    """The LoRA adapters (lora.manager.LoRAManager) a step's requests ask for."""

    def active(self, batch: Any) -> AbstractContextManager[None]:
        """The adapters of a HostBatch active for the forward run inside the block."""
        ...


class PoolerState(Protocol):
    """A pooling model's per-request pooling (pooling.pooler.Pooler)."""

    def update(
        self, hidden: torch.Tensor, spans: list[tuple[str, int, int, int, int]], params: dict
    ) -> dict[str, torch.Tensor]:
        """Fold the pooling rows' hidden states in; the outputs of the finished requests."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop an aborted request's partial state."""
        ...


class KVConnectorWorker(Protocol):
    """The worker side of a KV connector (kv_transfer_config): loads and saves blocks."""

    def load(self, pools: dict[str, KVPools], pairs: list[tuple[int, int]]) -> None:
        """Fill these blocks of the pools from the store."""
        ...

    def save(self, pools: dict[str, KVPools], pairs: list[tuple[int, int]]) -> None:
        """Store these blocks of the pools once the forward wrote them."""
        ...


class TokenChooser(Protocol):
    """How the runner turns a step's sample rows into tokens: plain sampling, or with a drafter
    the verification of its drafts (spec.verify.DraftVerifier)."""

    def __call__(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledRequest],
        rows_per_request: Sequence[int],
        draft_probs: dict[str, torch.Tensor] | None,
        pending: PendingTokens | None = None,
    ) -> dict[str, SampleResult]:
        """Each sampling request's result, by request id, on the host."""
        ...
