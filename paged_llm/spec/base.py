"""``Drafter``: what the engine asks of a speculative-decoding drafter, and nothing more.

A drafter proposes up to ``k`` tokens per scheduled decode; the target verifies them in one
forward (``spec/verify.py``, rejection sampling). The engine calls, in order:

* at start-up: ``load(context)`` (weights, shapes; a ``DraftContext`` describes the target),
  ``bytes_per_block(block_size)`` (its KV beside each block of the target's pool: the pool
  shrinks to fit both), ``allocate(...)``;
* each step: ``propose(entries, sampler)`` before the target's forward, then, for a drafter that
  ``reads_hidden_states``, ``observe(...)`` with the target's final hidden states;
* ``forget(request_id)`` when a request ends.

Capabilities are class flags, so the engine and the runner never probe for methods:
``uses_probs`` (propose returns draft distributions, else drafts are one-hot), ``runs_model``
(weights and KV on the device: sleep mode frees ``device_memory()``, and the runner captures
CUDA graphs of ``graph_inputs()``), ``moves_with_blocks`` (pools indexed by the target's blocks:
swaps and copies carry ``block_pools(where)`` along), ``reads_hidden_states``.

A new drafter is one class beside ngram.py / draft_model.py / eagle.py, named in
``spec/registry.py`` or given as ``speculative_config={"_target_": "pkg.MyDrafter", ...}``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class DraftContext:
    """What a drafter's ``load`` may read of the target: where it runs and what it must fit."""

    device: Any  # torch.device
    dtype: Any  # torch.dtype of the target's weights
    backend: Any  # attention.base.AttentionBackend the target uses
    model: Any  # the target model (an EAGLE head reads its embeddings and LM head)
    hf_config: Any  # the target's transformers config
    parallel: Any = None  # distributed.launch.TensorParallel, or None

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size: drafts must share it."""
        return self.hf_config.vocab_size


class Drafter(ABC):
    """Proposes draft tokens for the target to verify; the default hooks do nothing."""

    uses_probs: ClassVar[bool] = False
    runs_model: ClassVar[bool] = False
    moves_with_blocks: ClassVar[bool] = False
    reads_hidden_states: ClassVar[bool] = False

    k: int  # the most tokens drafted per sequence and step (num_speculative_tokens)
    # runs_model: the runner's CudaGraphRunner over graph_inputs(), handed in by use_cuda_graphs
    cuda_graphs: Any = None
    # request id -> where its last drafts came from (a drafter mixing sources of different
    # quality names them, so spec_stats can predict tokens per step per source)
    draft_sources: dict[str, str]

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.k = num_speculative_tokens
        self.draft_sources = {}

    def load(self, context: DraftContext) -> None:
        """Load weights on the target's device and check they fit its model (no-op)."""

    def bytes_per_block(self, block_size: int) -> int:
        """Device bytes of the drafter's own state per block of the shared pool (none)."""
        return 0

    def allocate(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """Allocate the drafter's pools beside the target's (none)."""

    @abstractmethod
    def propose(self, entries: list[Any], sampler: Any) -> tuple[dict[str, list[int]], dict]:
        """Drafts per scheduled entry (up to its ``num_lookahead``) by request id, and with
        ``uses_probs`` each one's draft distributions [n, V] by request id."""

    def observe(
        self, scheduled: list[Any], starts: dict[str, int], hidden: Any, will_draft: bool
    ) -> None:
        """After the target's forward: its final hidden states (``reads_hidden_states``)."""

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's state (none)."""

    # ---- for runs_model / moves_with_blocks drafters --------------------------------------------
    def device_memory(self) -> Any:
        """``runner.sleep.RankMemory`` of the drafter's weights and pools (runs_model)."""
        raise NotImplementedError(f"{type(self).__name__} sets runs_model but has no memory")

    def graph_inputs(self, sizes: list[int], strides: tuple[int, ...]) -> tuple[Any, Any, Any]:
        """(model, KV caches, strides) the runner captures CUDA graphs of (runs_model)."""
        raise NotImplementedError(f"{type(self).__name__} sets runs_model but has no graphs")

    def use_cuda_graphs(self, graphs: Any) -> None:
        """Keep the graphs the runner captured of ``graph_inputs()`` (None: run eagerly, e.g.
        after sleep or a failed capture); ``propose`` replays them when set (runs_model)."""
        self.cuda_graphs = graphs

    def block_pools(self, where: str) -> list[tuple[Any, ...]]:
        """The "device" or "cpu" pools that block moves carry along (moves_with_blocks)."""
        raise NotImplementedError(f"{type(self).__name__} sets moves_with_blocks but no pools")
