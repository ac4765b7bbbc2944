"""Property tests of the plain-Python allocators: block pool and buddy allocator."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.core.buddy import BuddyAllocator
from paged_llm.core.kv import POLICIES
from paged_llm.core.kv.block_pool import BlockPool
from paged_llm.core.request import Request
from paged_llm.sampling_params import SamplingParams
from paged_llm.utils.registry import build


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


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 16), ops=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4))))
def test_prefix_cache_reset_only_when_no_block_is_referenced(num_blocks, ops):
    """Register, free and reset in any order: a reset succeeds exactly when no block is
    referenced, and afterwards no lookup finds anything; a refused reset changes nothing."""
    pool = BlockPool(num_blocks)
    owners: list[list[int]] = []
    for op, n in ops:
        if op == 0 and n <= pool.num_free:
            blocks = pool.allocate(n)
            for b in blocks:
                pool.register(b, hash((b, n)), (b, n))
            owners.append(blocks)
        elif op == 1 and owners:
            pool.release(owners.pop(n % len(owners)))
        elif op >= 2:
            cached = {b for b in range(num_blocks) if pool.is_cached(b)}
            done = pool.reset_prefix_cache()
            assert done == (not owners)
            if done:
                assert not any(pool.is_cached(b) for b in range(num_blocks))
            else:
                assert {b for b in range(num_blocks) if pool.is_cached(b)} == cached
    for blocks in owners:
        pool.release(blocks)
    assert pool.reset_prefix_cache() and pool.num_free == num_blocks


def test_block_pool_rejects_over_allocation_and_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError):
        pool.release(blocks)


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


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(["orca_max", "orca_pow2", "orca_oracle", "static", "paged"]),
    num_blocks=st.integers(1, 200),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_model_len=st.integers(1, 256),
    prompt_len=st.integers(1, 256),
    max_tokens=st.integers(1, 256),
)
def test_fits_ever_means_it_runs_in_an_empty_pool(
    policy, num_blocks, block_size, max_model_len, prompt_len, max_tokens
):
    """A request the policy accepts can get the slots of its longest length in an empty pool,
    and one it refuses cannot (a 48-block pool has no 64-block buddy run: Orca (Max) once
    accepted a request there that then waited forever)."""
    if prompt_len + max_tokens > max_model_len:
        return
    kv, [req] = _empty_kv_and_requests(policy, num_blocks, block_size, max_model_len,
                                       prompt_len, max_tokens, 1)  # fmt: skip
    assert kv.fits_ever(req) == kv.allocate_slots(req, req.max_total_tokens)  # its longest
    assert kv.max_request_slots <= kv.num_slots


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(["orca_max", "orca_pow2", "orca_oracle", "static", "paged"]),
    num_blocks=st.integers(1, 100),
    block_size=st.sampled_from([1, 4, 16]),
    max_model_len=st.integers(16, 256),
    prompt_len=st.integers(1, 64),
    max_tokens=st.integers(1, 64),
    width=st.integers(2, 6),
)
def test_group_fits_ever_means_its_members_run_together_in_an_empty_pool(
    policy, num_blocks, block_size, max_model_len, prompt_len, max_tokens, width
):
    """Samples or beams run together: a group the policy accepts can hold all its members at
    their longest in an empty pool (exactly so for reservations, whose runs must pack: an
    11-block pool holds two 4-block runs, not three; the paged policy also keeps its
    watermark free)."""
    if prompt_len + max_tokens > max_model_len:
        return
    kv, group = _empty_kv_and_requests(policy, num_blocks, block_size, max_model_len,
                                       prompt_len, max_tokens, width)  # fmt: skip
    fits = kv.group_fits_ever(group)
    all_run = all(kv.allocate_slots(r, r.max_total_tokens) for r in group)
    assert fits == all_run if policy != "paged" else (not fits or all_run)


def _empty_kv_and_requests(
    policy, num_blocks, block_size, max_model_len, prompt_len, max_tokens, count
):
    """A fresh KV manager of ``policy`` and ``count`` alike greedy requests for it."""
    kv = build("policy", policy, POLICIES, num_blocks=num_blocks, block_size=block_size,
               max_model_len=max_model_len)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [
        Request(f"r{i}", [0] * prompt_len, params, max_model_len=max_model_len)
        for i in range(count)
    ]
    return kv, requests
