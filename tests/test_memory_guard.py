"""The hook that collects engines left in reference cycles once a worker's memory grew."""

from __future__ import annotations

import gc
import weakref

from memory_guard import GUARD, MemoryGuard, resident_bytes


def test_it_collects_only_after_the_growth_and_from_the_new_level():
    rss = iter([100, 150, 260, 120, 200, 250, 90])  # start, tests 1-4 (after 2 and 4: + after)
    guard = MemoryGuard(growth=100, measure=lambda: next(rss))
    assert not guard.after_test()  # +50
    assert guard.after_test() and guard.level == 120  # +160: collected, down to 120
    assert not guard.after_test()  # +80 from 120
    assert guard.after_test() and guard.collections == 2


def test_a_cycle_holding_a_tensor_is_freed_by_its_collection():
    import torch

    class Engine:
        def __init__(self):
            self.kv = torch.zeros(2**20)  # stands for a KV cache
            self.me = self  # the cycle

    gc.disable()  # as if Python's own collector had not come round yet
    try:
        engine = Engine()
        kv = weakref.ref(engine.kv)
        del engine
        assert kv() is not None  # garbage, still held
        assert MemoryGuard(growth=0).after_test()
        assert kv() is None
    finally:
        gc.enable()


def test_the_hook_is_the_shared_guard():
    assert resident_bytes() > 0 and GUARD.level > 0
