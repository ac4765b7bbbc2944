"""Drafting with a smaller model that shares the target's tokenizer.

The draft model keeps its own paged KV pool with the same number of blocks and reads it through
the target's block tables: the same tokens sit in the same slots, so one allocator (the target's
KV manager) manages both, and a rollback of the target rolls back the draft too.
"""

from __future__ import annotations

from itertools import accumulate
from types import SimpleNamespace
from typing import Any

import torch

from paged_llm.layers.attention import ForwardContext
from paged_llm.runner.kv_cache import allocate_kv_caches, kv_bytes_per_block
from paged_llm.runner.logits_processors import process_request_rows
from paged_llm.runner.sleep import RankMemory
from paged_llm.spec.any_order import build_metadata_any_order
from paged_llm.spec.base import DraftContext, Drafter
from paged_llm.spec.verify import is_plain_greedy


class DraftModelDrafter(Drafter):
    """Proposes k tokens per sequence by running the draft model k times (batched)."""

    uses_probs = True
    runs_model = True

    def __init__(self, num_speculative_tokens: int, model: str, **_: Any) -> None:
        super().__init__(num_speculative_tokens)
        self.model_path = model
        self._computed: dict[str, tuple[int, int]] = {}  # request -> (preemptions, tokens)

    def load(self, context: DraftContext) -> None:
        """Load the draft model on the target's device and check the vocabularies agree."""
        from paged_llm.engine.loading import checkpoint_path
        from paged_llm.models.loader import kv_cache_shape_info, load_model

        # Its linear layers stay on torch's default (MKL): a draft's weights fit in cache, where
        # MKL's lower per-call cost beats oneDNN up to 64 rows (experiments/cpu_matmul.py).
        self.model, cfg = load_model(
            checkpoint_path(self.model_path), context.dtype, context.device
        )
        if cfg.vocab_size != context.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({cfg.vocab_size}) differs from the target's "
                f"({context.vocab_size}); drafts must share the tokenizer"
            )
        self.shape = kv_cache_shape_info(cfg)
        self.device, self.dtype, self.backend = context.device, context.dtype, context.backend

    def bytes_per_block(self, block_size: int) -> int:
        """Draft KV bytes that each block of the shared pool costs."""
        return kv_bytes_per_block(*self.shape, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """The draft's KV pool, block for block beside the target's (no swap space: after a
        preemption the draft recomputes its KV from the tokens)."""
        self.block_size = block_size
        layers, heads, dim = self.shape
        self.kv_caches = allocate_kv_caches(
            layers, num_blocks, block_size, heads, dim, self.dtype, self.device
        )

    def device_memory(self) -> RankMemory:
        """For sleep mode: the draft's weights (load_weights never writes them, so a sleep
        always offloads them) and its KV pool."""
        weights = [*self.model.parameters(), *self.model.buffers()]
        return RankMemory([], weights, [t for pair in self.kv_caches for t in pair])

    def graph_inputs(
        self, sizes: list[int], strides: tuple[int, ...]
    ) -> tuple[Any, Any, tuple[int, ...]]:
        """What the runner captures CUDA graphs of (given back by ``use_cuda_graphs``): the
        draft model over its KV pool, at the target's strides (1 for the one-token steps,
        k + 1 for the catch-up)."""
        return self.model, self.kv_caches, strides

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(
        self, entries: list[Any], sampler: Any
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Draft up to each entry's lookahead tokens; return drafts and their distributions."""
        reqs = [s.request for s in entries]
        ks = [s.num_lookahead for s in entries]
        # tokens the draft has not seen yet (its KV is valid up to the target's rollback point)
        starts = []
        for r in reqs:
            version, done = self._computed.get(r.request_id, (r.num_preemptions, 0))
            if version != r.num_preemptions:  # blocks were recomputed or moved: start over
                done = 0
            starts.append(min(done, r.num_computed_tokens))
        feeds = [r.all_token_ids[st:] for r, st in zip(reqs, starts)]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for step in range(max(ks)):
            live = [i for i, k in enumerate(ks) if step < k]
            logits = self._forward([feeds[i] for i in live], [starts[i] for i in live],
                                   [entries[i].block_table for i in live])  # fmt: skip
            chosen = choose_draft_tokens(
                list(logits), [reqs[i] for i in live], [drafts[i] for i in live], sampler
            )
            for (tok, q), i in zip(chosen, live):
                drafts[i].append(tok)
                probs[i].append(q)
                starts[i] += len(feeds[i])
                feeds[i] = [tok]
        for r, st in zip(reqs, starts):
            self._computed[r.request_id] = (r.num_preemptions, st)
        out_probs = {
            r.request_id: torch.stack(p) for r, p in zip(reqs, probs) if p and p[0] is not None
        }
        return {r.request_id: d for r, d in zip(reqs, drafts)}, out_probs

    def _forward(self, feeds: list[list[int]], starts: list[int], tables: list[list[int]]):
        """Run the draft over each sequence's new tokens; logits at each last token [B, V]."""
        q_lens = [len(f) for f in feeds]
        seq_lens = [st + n for st, n in zip(starts, q_lens)]
        last = torch.tensor(list(accumulate(q_lens)), device=self.device) - 1  # caller's order
        step = SimpleNamespace(
            input_ids=[t for f in feeds for t in f], query_lens=q_lens, seq_lens=seq_lens,
            positions=[p for st, end in zip(starts, seq_lens) for p in range(st, end)],
            block_tables=tables,
        )  # fmt: skip
        key = self.cuda_graphs.key_for(step) if self.cuda_graphs is not None else None
        if key is not None:
            # k - 1 of the k steps are one-token decodes, the first a catch-up of <= k + 1
            return self.model.compute_logits(self.cuda_graphs.replay(step, key)[last])
        meta, rows, back = build_metadata_any_order(
            q_lens, seq_lens, tables, self.block_size, self.device,
            build=self.backend.build_metadata,
        )  # fmt: skip
        ids = torch.tensor(step.input_ids, device=self.device)[rows]
        pos = torch.tensor(step.positions, device=self.device)[rows]
        hidden = self.model(ids, pos, ForwardContext(meta, self.backend, self.kv_caches))
        return self.model.compute_logits(hidden[back[last]])


def choose_draft_tokens(
    logits: list[torch.Tensor],  # per sequence [V]
    requests: list[Any],
    drafted: list[list[int]],  # per sequence: this step's drafts so far
    sampler: Any,
) -> list[tuple[int, torch.Tensor | None]]:
    """``choose_draft_token`` for each sequence, in order; the greedy ones with nothing to
    process share one argmax and one device sync (on a GPU a sync per sequence and step
    would cost more than the draft forward)."""
    plain = [i for i, (r, d) in enumerate(zip(requests, drafted)) if is_plain_greedy(r, len(d))]
    picks: dict[int, tuple[int, torch.Tensor | None]] = {}
    if plain:
        ids = torch.stack([logits[i] for i in plain]).argmax(-1).tolist()
        picks = {i: (int(t), None) for i, t in zip(plain, ids)}
    return [
        picks[i] if i in picks else choose_draft_token(logits[i], requests[i], drafted[i], sampler)
        for i in range(len(requests))
    ]


def choose_draft_token(
    logits: torch.Tensor,  # [V]
    request: Any,
    drafted: list[int],  # this step's drafts so far
    sampler: Any,
) -> tuple[int, torch.Tensor | None]:
    """Greedy target: the draft's argmax. Sampling: a draw from the draft's q, kept for the
    acceptance test min(1, p/q). The request's penalties and bias shape the draft's logits
    as they will the target's, so drafts follow what the target is asked to produce."""
    params = request.sampling_params
    logits = process_request_rows(
        logits[None].float(), request, [request.output_token_ids + drafted]
    )[0]
    if params.greedy:
        return int(logits.argmax()), None
    q = sampler.probs(logits[None], params)[0]
    gen = sampler.generator(request.request_id, params)
    return int(torch.multinomial(q, 1, generator=gen)), q
