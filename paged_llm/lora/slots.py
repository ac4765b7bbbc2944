"""Which adapter sits in which of the ``max_loras`` device slots (plain Python, no torch).

A step may use at most ``max_loras`` distinct adapters (the scheduler sees to it). Adapters that
stay resident keep their slot, so only newly needed ones are copied in; a slot is reused in
least-recently-used order, like a tiny cache.
"""

from __future__ import annotations

import itertools


class LoRASlots:
    """Adapter id -> device slot, with least-recently-used replacement."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.slots: list[int | None] = [None] * max_loras  # adapter id held by each slot
        self._last_used: list[int] = [-1] * max_loras
        self._clock = itertools.count()

    def slot_of(self, lora_id: int) -> int | None:
        """The slot holding this adapter, if resident."""
        return self.slots.index(lora_id) if lora_id in self.slots else None

    def assign(self, lora_ids: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for this step's adapters: (id -> slot, [(slot, id) to copy in]). Resident
        adapters stay put; a new one takes an empty slot, else the least recently used slot
        of an adapter this step does not need."""
        if len(lora_ids) > len(self.slots):
            raise ValueError(
                f"a step uses {len(lora_ids)} adapters, more than max_loras={len(self.slots)}"
            )
        now = next(self._clock)
        mapping: dict[int, int] = {}
        loads: list[tuple[int, int]] = []
        for lora_id in sorted(lora_ids):
            slot = self.slot_of(lora_id)
            if slot is not None:
                mapping[lora_id] = slot
                self._last_used[slot] = now
        for lora_id in sorted(lora_ids - set(mapping)):
            free = [s for s, held in enumerate(self.slots) if held not in lora_ids]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._last_used[s]))
            self.slots[slot] = lora_id
            self._last_used[slot] = now
            mapping[lora_id] = slot
            loads.append((slot, lora_id))
        return mapping, loads

    def evict(self, lora_id: int) -> None:
        """Forget an adapter (it was removed); its slot becomes free."""
        slot = self.slot_of(lora_id)
        if slot is not None:
            self.slots[slot] = None
            self._last_used[slot] = -1
