"""Pooling types: how a prompt's final hidden states [L, H] become the request's output.

Prompts may arrive in several chunks (chunked prefill), so each type is a small fold: ``update``
takes the hidden states of one chunk (prompt positions ``start .. start + n``) and returns the
new state, ``result`` turns the state into the output. A chunk starting at position 0 starts a
new fold (a request preempted by recomputation runs its prompt again). ``needs_all_tokens``:
every prompt position must run, so a prefix-cache hit (which skips positions) is not allowed.
"""

from __future__ import annotations

from typing import Any

import torch


class PoolingMethod:
    """Interface; see the module docstring."""

    name = ""
    needs_all_tokens = True
    per_token = False  # one output row per prompt token ([L, H]) instead of one vector ([H])

    def update(self, state: Any, hidden: torch.Tensor, start: int, prompt_len: int) -> Any:
        """Fold one chunk's hidden states [n, H] (positions start .. start + n) into state."""
        raise NotImplementedError

    def result(self, state: Any) -> torch.Tensor:
        """The pooled output: [H], or [L, H] for per-token methods."""
        raise NotImplementedError


class LastPooling(PoolingMethod):
    """The last prompt token's hidden state (decoder embedders: Qwen3-Embedding, e5-mistral)."""

    name = "LAST"
    needs_all_tokens = False  # the last position always runs, cached prefix or not

    def update(self, state: Any, hidden: torch.Tensor, start: int, prompt_len: int) -> Any:
        """Keep the row of position prompt_len - 1 once its chunk arrives."""
        return hidden[-1] if start + hidden.shape[0] == prompt_len else state

    def result(self, state: Any) -> torch.Tensor:
        """That row."""
        return state


class CLSPooling(PoolingMethod):
    """The first prompt token's hidden state (BERT's [CLS] convention)."""

    name = "CLS"

    def update(self, state: Any, hidden: torch.Tensor, start: int, prompt_len: int) -> Any:
        """Keep the row of position 0."""
        return hidden[0] if start == 0 else state

    def result(self, state: Any) -> torch.Tensor:
        """That row."""
        return state


class MeanPooling(PoolingMethod):
    """The mean of every prompt token's hidden state, summed in float32 across chunks."""

    name = "MEAN"

    def update(self, state: Any, hidden: torch.Tensor, start: int, prompt_len: int) -> Any:
        """Add the chunk's rows to the running sum (restarted at position 0)."""
        total, count = (0.0, 0) if start == 0 or state is None else state
        return total + hidden.float().sum(0), count + hidden.shape[0]

    def result(self, state: Any) -> torch.Tensor:
        """Sum / count."""
        total, count = state
        return total / count


class AllPooling(PoolingMethod):
    """Every prompt token's hidden state, [L, H] (token embeddings)."""

    name = "ALL"
    per_token = True

    def update(self, state: Any, hidden: torch.Tensor, start: int, prompt_len: int) -> Any:
        """Append the chunk's rows (restarted at position 0)."""
        rows = [] if start == 0 or state is None else state
        return [*rows, hidden]

    def result(self, state: Any) -> torch.Tensor:
        """The rows in prompt order."""
        return torch.cat(state)


POOLING_METHODS: dict[str, type[PoolingMethod]] = {
    m.name: m for m in (LastPooling, CLSPooling, MeanPooling, AllPooling)
}
