"""Drafting with an EAGLE head (``models/eagle.py``): one decoder layer over the target's features.

The head's KV (one layer) and the target's feature at every position live in pools with the
target's block ids and move with its blocks (copy-on-write, swap), so the target's KV manager
allocates, shares and frees them at once. Invariant: at every position the target has computed,
the pools hold the target's feature and the head's KV of the true pair. Both depend on x_0..x_j
only, so blocks found by prefix caching or shared by a fork hold valid values too, and the
drafter keeps no per-request state at all.

Each step has two parts:

- ``observe`` (after the target's forward and the scheduler's update): the target computed
  positions [a, b) of each request; its features f_a..f_{b-1} come back from the runner. The
  drafter stores them and writes the head's KV for positions [a, b) from the pairs
  (x_j, f_{j-1}), f_{a-1} read from the pool, so the invariant holds after every step whether
  or not the request drafts next.
- ``propose`` (before the next forward): from (x_b, f_{b-1}), b the request's computed tokens,
  the head predicts f_b, the target's LM head turns it into draft d_1, and (d_1, predicted f_b)
  gives d_2, and so on, k times. The KV written for drafts is overwritten by the next
  ``observe``.

The first of those k head forwards rides along with ``observe`` where it can (as vLLM's EAGLE
does): once the target has sampled x_b, the pair (x_b, f_{b-1}) is known, so ``observe`` adds
position b to its forward and keeps the predicted f_b and its logits for ``propose``, which
then runs k - 1 forwards. Position b's slot must already be the request's: b's block is b-1's
(b not a multiple of the block size), which the request just wrote and so holds privately (a
fork's copy-on-write happened before that write, and a block that is not full is in no prefix
cache). Elsewhere, and whenever the block moved since (swap, recomputation), ``propose`` runs
the step itself. The head's KV at b is then the true pair's, as the invariant asks anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from paged_llm.layers.attention import ForwardContext
from paged_llm.runner.batch import order_for_backend
from paged_llm.runner.kv_cache import KVCaches, allocate_kv_caches, kv_bytes_per_block
from paged_llm.runner.sleep import RankMemory
from paged_llm.spec.any_order import build_metadata_any_order
from paged_llm.spec.base import DraftContext, Drafter
from paged_llm.spec.draft_model import choose_draft_tokens


def whole_embedding_and_head(model: Any) -> tuple[nn.Embedding, Any]:
    """The target's token embedding and LM head, unsplit, gathered from the ranks' vocabulary
    slices (a collective: every rank calls it): (embedding, hidden [N, H] -> float32 logits
    [N, V])."""
    from paged_llm.distributed.parallel_state import all_gather_rows

    vocab = model.config.vocab_size  # the gathered tables hold the padded vocabulary
    embed = nn.Embedding.from_pretrained(
        all_gather_rows(model.get_input_embeddings().weight)[:vocab]
    )
    head = (
        embed.weight if model.tie_word_embeddings else all_gather_rows(model.lm_head.weight)[:vocab]
    )
    return embed, lambda hidden: torch.nn.functional.linear(hidden, head).float()


class _HeadStep(nn.Module):
    """The head as a CUDA graph captures a model, ``(token ids, positions, ctx) -> [T, H]``:
    the previous features come from a static buffer that the replay fills first."""

    def __init__(self, head: nn.Module, embed: nn.Module, features: torch.Tensor) -> None:
        super().__init__()
        self.head, self.embed, self.features = head, embed, features  # features [tokens, H]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Predicted features of the first ids.shape[0] rows."""
        return self.head(self.embed(ids), self.features[: ids.shape[0]], positions, ctx)


@dataclass
class _FirstStep:
    """A request's first draft step, run by ``observe`` for the next ``propose``."""

    position: int  # b: the request's computed tokens when observe ran
    block: int  # the block holding position b (the step wrote the head's KV there)
    feature: torch.Tensor  # [H] the head's predicted f_b
    logits: torch.Tensor  # [V] the target's LM head on it


class EagleDrafter(Drafter):
    """Proposes k tokens per sequence with an EAGLE head on the target's features."""

    uses_probs = True
    runs_model = True
    moves_with_blocks = True  # its KV and feature pools are indexed by the target's blocks
    reads_hidden_states = True  # the runner keeps each forward's final hidden states for it

    def __init__(self, num_speculative_tokens: int, model: str, **_: Any) -> None:
        super().__init__(num_speculative_tokens)
        self.model_path = model
        self._first: dict[str, _FirstStep] = {}  # request -> draft step 1, run by observe
        self._graph_features: torch.Tensor | None = None  # [tokens, H] the graphs' input

    def load(self, context: DraftContext) -> None:
        """Load the head on the target's device; it reads the target's embeddings and LM head."""
        from paged_llm.engine.loading import checkpoint_path
        from paged_llm.models.eagle import load_eagle_head
        from paged_llm.models.loader import kv_cache_shape_info

        self.head, cfg = load_eagle_head(checkpoint_path(self.model_path), context.dtype,
                                         context.device)  # fmt: skip
        target = context.hf_config
        if cfg.hidden_size != target.hidden_size or cfg.vocab_size != context.vocab_size:
            raise ValueError(
                f"EAGLE head (hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}) does not "
                f"fit the target (hidden {target.hidden_size}, vocabulary {context.vocab_size})"
            )
        if context.parallel is None:
            self.embed, self.logits_of = (
                context.model.get_input_embeddings(),
                context.model.compute_logits,
            )
        else:  # the target's are split across ranks; rank 0 drafts alone, so it needs them whole
            self.embed, self.logits_of = whole_embedding_and_head(context.model)
        _, self.num_kv_heads, self.head_dim = kv_cache_shape_info(cfg)
        self.hidden = cfg.hidden_size
        self.device, self.dtype, self.backend = context.device, context.dtype, context.backend

    def bytes_per_block(self, block_size: int) -> int:
        """Head KV plus the target's feature per slot, for each block of the shared pool."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        kv = kv_bytes_per_block(1, self.num_kv_heads, self.head_dim, block_size, self.dtype)
        return kv + block_size * self.hidden * elem

    def allocate(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """The head's pools, block for block beside the target's (and its swap space)."""
        self.block_size = block_size
        self.kv_caches, self.features = self._pools(num_blocks, self.device)
        self.cpu_caches, self.cpu_features = self._pools(num_cpu_blocks, "cpu")

    def _pools(self, num_blocks: int, device: Any) -> tuple[KVCaches, torch.Tensor]:
        pin = str(device) == "cpu" and self.device.type == "cuda"
        kv = allocate_kv_caches(1, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                                self.dtype, device, pin)  # fmt: skip
        shape = (num_blocks, self.block_size, self.hidden)  # the target's feature per slot
        feats = torch.zeros(shape, dtype=self.dtype, device=device)
        return kv, feats.pin_memory() if pin else feats

    def block_pools(self, where: str) -> list[tuple[torch.Tensor, ...]]:
        """What the runner's block moves carry along: "device" or "cpu" (swap) pools."""
        if where == "device":
            return [*self.kv_caches, (self.features,)]
        return [*self.cpu_caches, (self.cpu_features,)]

    def device_memory(self) -> RankMemory:
        """For sleep mode: the head's weights (load_weights never writes them) and its pools."""
        weights = [*self.head.parameters(), *self.head.buffers()]
        pools = [t for group in self.block_pools("device") for t in group]
        return RankMemory([], weights, pools)

    def graph_inputs(
        self, sizes: list[int], strides: tuple[int, ...]
    ) -> tuple[Any, Any, tuple[int, ...]]:
        """What the runner captures CUDA graphs of (given back by ``use_cuda_graphs``): the
        head reading its features from a static buffer, over its KV pool. Strides 1
        (propose's steps) and k + 2 (observe: up to k + 1 computed tokens and the first draft
        step)."""
        strides = (1, self.k + 2)
        tokens = max(sizes) * max(strides)
        self._graph_features = torch.zeros(tokens, self.hidden, dtype=self.dtype,
                                           device=self.device)  # fmt: skip
        return _HeadStep(self.head, self.embed, self._graph_features), self.kv_caches, strides

    def forget(self, request_id: str) -> None:
        """Drop the request's first draft step, if ``observe`` ran it; the rest lives in its
        blocks."""
        self._first.pop(request_id, None)

    # ---- after the target's forward -----------------------------------------------------------
    @torch.inference_mode()
    def observe(
        self,
        scheduled: list[Any],
        starts: dict[str, int],  # request -> its first position in this step
        hidden: torch.Tensor,  # [T, H] the target's final hidden states, in the runner's order
        will_draft: bool = True,  # False: the next step drafts nothing (disable_by_batch_size)
    ) -> None:
        """Store the target's new features and write the head's KV at the same positions (and,
        if the next step drafts, run its first draft step where the block allows)."""
        spans = []  # (entry, a, b, rows [b - a, H]) per request with newly computed positions
        row = 0
        for s in order_for_backend(scheduled):  # the row order of the runner's flat batch
            req, n = s.request, s.num_new_tokens
            a = starts[req.request_id]
            b = min(a + n, req.num_computed_tokens)  # drafts past the rollback point are gone
            if b > a and not req.is_pooling:
                spans.append((s, a, b, hidden[row : row + b - a]))
            row += n
        if spans:
            self._store_features([(s.block_table, a, rows) for s, a, _, rows in spans])
        self._first = {}
        ids, feats, positions, q_lens, seq_lens, tables = [], [], [], [], [], []
        firsts = []  # (request id, row of position b, its block) where observe drafts step 1
        for s, a, b, rows in spans:
            prev = self.feature_at(s.block_table, a - 1) if a else rows.new_zeros(self.hidden)
            feats.append(torch.cat([prev[None].to(rows.dtype), rows[:-1]]))
            ids.extend(s.request.all_token_ids[a:b])
            positions.extend(range(a, b))
            if will_draft and self._drafts_next(s.request, b):  # + position b: (x_b, f_{b-1})
                feats.append(rows[-1:])
                ids.append(s.request.all_token_ids[b])
                positions.append(b)
                block = s.block_table[b // self.block_size]
                firsts.append((s.request.request_id, len(ids) - 1, block))
                b += 1
            q_lens.append(b - a)
            seq_lens.append(b)
            tables.append(s.block_table)
        if q_lens:
            out = self._run(ids, torch.cat(feats), positions, q_lens, seq_lens, tables)
            if firsts:
                rows_t = torch.tensor([r for _, r, _ in firsts], device=out.device)
                logits = self.logits_of(out[rows_t])
                for i, (rid, row, block) in enumerate(firsts):
                    self._first[rid] = _FirstStep(positions[row], block, out[row], logits[i])

    def _drafts_next(self, request: Any, b: int) -> bool:
        """Whether observe should run the request's first draft step: it has sampled x_b (its
        only uncomputed token) and may draft, and position b shares b-1's block."""
        return b % self.block_size != 0 and request.num_tokens == b + 1 and not request.is_finished

    def feature_at(self, table: list[int], position: int) -> torch.Tensor:  # [H]
        """The target's stored feature at ``position`` of a sequence with this block table."""
        bs = self.block_size
        return self.features[table[position // bs], position % bs]

    def _store_features(self, spans: list[tuple[list[int], int, torch.Tensor]]) -> None:
        """Write each span's features [n, H] into positions start.. of its block table's
        slots, all spans with one index copy to the device (each one a host sync on a GPU)."""
        bs = self.block_size
        slots = [(table[p // bs], p % bs) for table, start, rows in spans
                 for p in range(start, start + rows.shape[0])]  # fmt: skip
        index = torch.tensor(slots, dtype=torch.long).to(self.features.device)  # [N, 2]
        values = torch.cat([rows for _, _, rows in spans])
        self.features[index[:, 0], index[:, 1]] = values.to(self.dtype)

    def _run(
        self,
        ids: list[int],
        features: torch.Tensor,  # [T, H]
        positions: list[int],
        q_lens: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:  # [T, H]
        """One head forward over the flat batch [T] given in the caller's order."""
        step = SimpleNamespace(input_ids=ids, positions=positions, query_lens=q_lens,
                               seq_lens=seq_lens, block_tables=tables)  # fmt: skip
        key = self.cuda_graphs.key_for(step) if self.cuda_graphs is not None else None
        if key is not None:
            # a copy: observe keeps rows of it (_FirstStep) past the next replay
            extra = [(self._graph_features, features)]
            return self.cuda_graphs.replay(step, key, extra).clone()
        meta, rows, back = build_metadata_any_order(
            q_lens, seq_lens, tables, self.block_size, self.device,
            build=self.backend.build_metadata,
        )  # fmt: skip
        ids_t = torch.tensor(ids, device=self.device)[rows]
        pos_t = torch.tensor(positions, device=self.device)[rows]
        out = self.head(self.embed(ids_t), features[rows], pos_t,
                        ForwardContext(meta, self.backend, self.kv_caches))  # fmt: skip
        return out[back]

    # ---- before the next forward --------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self, entries: list[Any], sampler: Any
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Draft up to each entry's lookahead tokens; return drafts and their distributions."""
        # a request's head cache is always up to its computed tokens (see observe)
        live = [s for s in entries if s.request.num_computed_tokens > 0]
        drafts: dict[str, list[int]] = {s.request.request_id: [] for s in entries}
        probs: dict[str, list[torch.Tensor]] = {}
        starts = [s.request.num_computed_tokens for s in live]
        tokens = [s.request.all_token_ids[b] for s, b in zip(live, starts)]
        feats = [self.feature_at(s.block_table, b - 1) for s, b in zip(live, starts)]
        first, self._first = self._first, {}
        done = {i for i, s in enumerate(live) if self._first_is_valid(first, s, starts[i])}
        for step in range(max((s.num_lookahead for s in live), default=0)):
            idx = [i for i, s in enumerate(live) if step < s.num_lookahead]
            run = [i for i in idx if step > 0 or i not in done]
            pos = [starts[i] + step for i in run]
            out, logits = {}, {}
            if run:
                h = self._run([tokens[i] for i in run], torch.stack([feats[i] for i in run]),
                              pos, [1] * len(run), [p + 1 for p in pos],
                              [live[i].block_table for i in run])  # fmt: skip
                lg = self.logits_of(h)
                for row, i in enumerate(run):
                    out[i], logits[i] = h[row], lg[row]
            for i in idx:
                rid = live[i].request.request_id
                if i not in out:  # observe ran this step
                    out[i], logits[i] = first[rid].feature, first[rid].logits
            chosen = choose_draft_tokens(  # in entry order, so sampled drafts draw as before
                [logits[i] for i in idx], [live[i].request for i in idx],
                [drafts[live[i].request.request_id] for i in idx], sampler,
            )  # fmt: skip
            for (tok, q), i in zip(chosen, idx):
                rid = live[i].request.request_id
                drafts[rid].append(tok)
                if q is not None:
                    probs.setdefault(rid, []).append(q)
                tokens[i], feats[i] = tok, out[i]
        return drafts, {rid: torch.stack(p) for rid, p in probs.items()}

    def _first_is_valid(self, first: dict[str, _FirstStep], entry: Any, start: int) -> bool:
        """True when observe ran this entry's first draft step at its position and block."""
        step = first.get(entry.request.request_id)
        return (
            step is not None
            and step.position == start
            and entry.block_table[start // self.block_size] == step.block
        )
