"""Property tests of the plain-Python allocators: block pool and buddy allocator."""

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.core.block_pool import BlockPool
from paged_llm.core.buddy import BuddyAllocator


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 64), ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8))))
def test_block_pool_never_leaks_or_double_frees(num_blocks, ops):
    pool = BlockPool(num_blocks)
    owners: list[list[int]] = []  # each entry holds one reference to each of its blocks
    for op, n in ops:
        if op == 0 and n <= pool.num_free:
            owners.append(pool.allocate(n))
        elif op == 1 and owners:
            shared = owners[n % len(owners)]
            pool.share(shared)
            owners.append(list(shared))
        elif op == 2 and owners:
            pool.release(owners.pop(n % len(owners)))
        refs = [0] * num_blocks
        for blocks in owners:
            for b in blocks:
                refs[b] += 1
        assert refs == pool.ref_counts
        assert pool.num_free == sum(r == 0 for r in refs)
    for blocks in owners:
        pool.release(blocks)
    assert pool.num_free == num_blocks and not any(pool.ref_counts)


def test_block_pool_rejects_over_allocation_and_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    try:
        pool.allocate(1)
        raise AssertionError("expected MemoryError")
    except MemoryError:
        pass
    pool.release(blocks)
    try:
        pool.release(blocks)
        raise AssertionError("expected RuntimeError")
    except RuntimeError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(1, 300),
    max_order=st.integers(0, 6),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 64)), max_size=60),
)
def test_buddy_runs_are_aligned_disjoint_and_coalesce(num_blocks, max_order, ops):
    buddy = BuddyAllocator(num_blocks, max_order)
    initial_free = buddy.num_free_blocks
    live: dict[int, int] = {}
    for alloc, n in ops:
        if alloc:
            can = buddy.can_allocate(n)
            run = buddy.allocate(n)
            assert (run is not None) == can
            if run is not None:
                start, length = run
                assert length >= n and length & (length - 1) == 0 and start % length == 0
                assert start + length <= num_blocks
                for s, ln in live.items():
                    assert start + length <= s or s + ln <= start  # disjoint
                live[start] = length
        elif live:
            start = sorted(live)[n % len(live)]
            buddy.free(start)
            del live[start]
        assert buddy.num_free_blocks + sum(live.values()) == initial_free
    for start in list(live):
        buddy.free(start)
    assert buddy.num_free_blocks == initial_free
    # after freeing everything, the largest run is whole again
    assert buddy.largest_free_run() == min(1 << max_order, 1 << (num_blocks.bit_length() - 1))
