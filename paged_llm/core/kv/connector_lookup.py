"""The paged manager's use of a KV connector (kv_transfer/, disaggregated prefill): the
connector's content keys of each request's full blocks, the lookup of a prompt's blocks in the
connector's store (a consumer loads them instead of computing them), and the plan of which
computed prompt blocks a producer saves (no torch).

The connector's scheduler side answers ``block_keys`` and ``contains`` and says whether this
engine ``can_load`` and ``can_save``; the copies themselves are logged as the step's
("kv_load", [(key, block)]) and ("kv_save", [(block, key)]) block moves, which the runner does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_llm.core.kv.base import NULL_BLOCK
from paged_llm.core.kv.block_pool import BlockPool
from paged_llm.core.kv.prefix_cache import TierLookup
from paged_llm.core.request import Request


class ConnectorLookup:
    """Keys, store lookups, loads and save plans of one engine's KV connector."""

    def __init__(
        self,
        connector: Any,
        pool: BlockPool,
        block_size: int,
        register_loads: bool,
        log: Callable[[str, list[tuple[int, int]]], None],
    ) -> None:
        self.connector, self.pool, self.block_size = connector, pool, block_size
        self.register_loads = register_loads  # loaded blocks join the device prefix cache
        self.log = log
        self.keys: dict[str, list[int]] = {}  # request -> connector keys of its blocks

    @property
    def can_load(self) -> bool:
        """This engine loads blocks the connector's store holds (a consumer)."""
        return bool(self.connector.can_load)

    @property
    def can_save(self) -> bool:
        """This engine saves its prompt blocks to the store (a producer)."""
        return bool(self.connector.can_save)

    def block_keys(self, request: Request, num_blocks: int) -> list[int]:
        """The connector's content keys of the request's first ``num_blocks`` full blocks."""
        known = self.keys.setdefault(request.request_id, [])
        # a LoRA adapter's blocks get keys of their own, as they get hash chains of their own
        salt = f"lora:{request.lora_int_id}" if request.lora_int_id else ""
        return self.connector.block_keys(
            known, request.all_token_ids, self.block_size, num_blocks, salt
        )[:num_blocks]

    def tier_for(self, request: Request, num_blocks: int) -> TierLookup:
        """The lookup of the request's first ``num_blocks`` blocks in the store, as a
        ``PrefixCache`` tier: block i -> ("ext", key) when the store holds it."""
        keys = self.block_keys(request, num_blocks)

        def find(i: int, _hash: int, _tokens: tuple[int, ...]) -> tuple[str, int] | None:
            return ("ext", keys[i]) if self.connector.contains(keys[i]) else None

        return find

    def load(self, key: int, block_hash: int, tokens: tuple[int, ...]) -> int:
        """A fresh device block that the step's connector load fills from the store's block
        ``key``; it joins the device prefix cache (if on) at once, as a CPU-tier load does."""
        (block,) = self.pool.allocate(1)
        self.log("kv_load", [(key, block)])
        if self.register_loads:
            self.pool.register(block, block_hash, tokens)
        return block

    def plan_saves(self, scheduled: list[Any], block_tables: dict[str, list[int]]) -> None:
        """Producer: log a save of every full prompt block this step computes that the store
        lacks (the runner writes them after the forward pass)."""
        bs = self.block_size
        pairs: list[tuple[int, int]] = []
        logged: set[int] = set()
        for s in scheduled:
            req = s.request
            start = req.num_computed_tokens // bs
            end = min(req.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens) // bs
            if end <= start:
                continue
            keys = self.block_keys(req, end)
            table = block_tables[req.request_id]
            for i in range(start, end):
                key = keys[i]
                if (
                    table[i] != NULL_BLOCK
                    and key not in logged
                    and not self.connector.contains(key)
                ):
                    logged.add(key)
                    pairs.append((table[i], key))
        if pairs:
            self.log("kv_save", pairs)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares the parent's tokens so far, hence its keys."""
        if parent_id in self.keys:
            self.keys[child_id] = list(self.keys[parent_id])

    def forget(self, request_id: str) -> None:
        """Drop a finished request's keys."""
        self.keys.pop(request_id, None)
