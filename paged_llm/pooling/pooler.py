"""The runner's side of pooling: fold each pooling request's prompt chunks (their final hidden
states) with the configured method, and post-process finished requests (Matryoshka truncation
and L2 normalisation for embeddings; the score head and activation for a classifier)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from paged_llm.pooling.classifier import ClassifierHead
from paged_llm.pooling.config import PoolerConfig
from paged_llm.pooling.methods import POOLING_METHODS, PoolingMethod


class Pooler:
    """Per-request pooling state, keyed by request id, across a request's prompt chunks."""

    def __init__(self, config: PoolerConfig, head: ClassifierHead | None = None) -> None:
        self.config = config
        self.method: PoolingMethod = POOLING_METHODS[config.pooling_type]()
        self.head = head  # a classifier's score head + activation; None for embedding models
        self._states: dict[str, Any] = {}
        if head is not None:
            self.require_one_vector("a sequence classifier")

    def update(
        self,
        hidden: torch.Tensor,  # [P, H] the rows of every pooling span, in span order
        spans: list[tuple[str, int, int, int, int]],  # HostBatch.pool_spans
        params: dict[str, Any],  # request id -> PoolingParams
    ) -> dict[str, torch.Tensor]:
        """Fold this step's chunks; return the outputs (on the CPU, float32) of the requests
        whose prompt this step completed."""
        done: dict[str, torch.Tensor] = {}
        row = 0
        for request_id, _, start, count, prompt_len in spans:  # _: its first row in the batch
            chunk = hidden[row : row + count]
            row += count
            state = self.method.update(self._states.get(request_id), chunk, start, prompt_len)
            if start + count < prompt_len:
                self._states[request_id] = state
                continue
            self._states.pop(request_id, None)
            done[request_id] = self._finish(self.method.result(state), params[request_id])
        return done

    def require_one_vector(self, what: str) -> None:
        """ValueError when this pooler gives one vector per token (pooling_type ALL), which
        ``what`` cannot use."""
        if self.method.per_token:
            raise ValueError(
                f"{what} needs one vector per prompt, but pooling_type is ALL (one per token); "
                "LLM.encode returns those"
            )

    def _finish(self, pooled: torch.Tensor, params: Any) -> torch.Tensor:
        """A classifier's probabilities (or logits); else truncate to ``dimensions``, then
        normalise if asked (per row for per-token output)."""
        if self.head is not None:
            return self.head(pooled, activation=params.activation is not False).cpu()
        out = pooled.float()
        if params.dimensions is not None:
            out = out[..., : params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            out = F.normalize(out, p=2, dim=-1)
        return out.cpu()

    def forget(self, request_id: str) -> None:
        """Drop an aborted request's partial state."""
        self._states.pop(request_id, None)
