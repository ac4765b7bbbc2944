"""The paged policy's prefix cache, offload and connector lookups, driven directly (no manager):
core/kv/prefix_cache.py, core/kv/offload.py and core/kv/connector_lookup.py."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from paged_llm.core.kv.block_pool import BlockPool
from paged_llm.core.kv.connector_lookup import ConnectorLookup
from paged_llm.core.kv.offload import OffloadedPrefixes, PrefixOffloadTier
from paged_llm.core.kv.prefix_cache import PrefixCache
from paged_llm.core.request import Request
from paged_llm.sampling_params import SamplingParams

BS = 2  # tokens per block


def request(rid: str, prompt: list[int]) -> Request:
    """A request of ``prompt`` (nothing computed yet)."""
    return Request(rid, list(prompt), SamplingParams(max_tokens=1), max_model_len=64)


def chain(prompt: list[int]) -> list[int]:
    """The hash chain of the prompt's full blocks, written out independently of the module."""
    out: list[int] = []
    for i in range(len(prompt) // BS):
        out.append(hash((out[-1] if out else None, tuple(prompt[i * BS : (i + 1) * BS]))))
    return out


# prompts over two token ids share prefixes often; pools of 4 to 6 blocks evict often
prompts = st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=4 * BS), max_size=25)


@settings(max_examples=200, deadline=None)
@given(prompts, st.integers(4, 6))
def test_lookups_return_only_blocks_holding_the_prompts_prefix(batch, num_blocks):
    pool = BlockPool(num_blocks)
    cache = PrefixCache(pool, BS, sliding_window=None)
    content: dict[int, tuple[int, tuple[int, ...]] | None] = {}  # block -> what was written
    evicted: set[tuple[int, int]] = set()  # (block, hash) evicted and not registered since
    pool.on_evict = lambda block, h, _tokens: evicted.add((block, h))
    for n, prompt in enumerate(batch):
        req = request(f"r{n}", prompt)
        hashes = cache.block_hashes(req, len(prompt))
        assert hashes == chain(prompt)
        found, keys = cache.find(hashes, prompt)
        # a leading run of hits, then at most one miss where the walk stopped, in prompt order
        num, first = cache.longest_prefix(found)
        assert first == 0 and all(isinstance(b, int) for b in found[:num])
        assert found[num:] in ([], [None]) and len(set(found[:num])) == num
        for i, b in enumerate(found[:num]):
            assert keys[i] == tuple(prompt[i * BS : (i + 1) * BS])
            assert content[b] == (hashes[i], keys[i])  # the block holds exactly this prefix
            assert (b, hashes[i]) not in evicted
        # compute the rest of the prompt in fresh blocks, register, finish
        table = cache.take(found[:num], 0, hashes, keys, {})
        fresh = pool.allocate(-(-len(prompt) // BS) - num)
        for j, b in enumerate(fresh, start=num):
            full = j < len(hashes)
            content[b] = (hashes[j], tuple(prompt[j * BS : (j + 1) * BS])) if full else None
        table += fresh
        req.num_computed_tokens = len(prompt)
        cache.register(req, table, 0)
        for i, h in enumerate(hashes):
            if pool.lookup(h, tuple(prompt[i * BS : (i + 1) * BS])) == table[i]:
                evicted.discard((table[i], h))
        pool.release(table[::-1])
        cache.forget(req.request_id)
        assert not cache.hashes and pool.num_free == num_blocks
    # equal hashes mean equal prefixes
    for a in batch:
        for b in batch:
            for i, (ha, hb) in enumerate(zip(chain(a), chain(b))):
                assert (ha == hb) == (a[: (i + 1) * BS] == b[: (i + 1) * BS])


def test_lower_tiers_are_asked_in_order_only_after_a_device_miss():
    pool = BlockPool(4)
    cache = PrefixCache(pool, BS, sliding_window=None)
    prompt = [1, 2, 3, 4, 5, 6]
    req = request("a", prompt)
    hashes = cache.block_hashes(req, len(prompt))
    (b0,) = pool.allocate(1)
    pool.register(b0, hashes[0], (1, 2))
    asked: list[tuple[str, int]] = []

    def tier(name: str, holds: set[int]):
        def find(i, _h, _tokens):
            asked.append((name, i))
            return (name, 10 + i) if i in holds else None

        return find

    found, _ = cache.find(hashes, prompt, [tier("cpu", {1}), tier("ext", {1, 2})])
    assert found == [b0, ("cpu", 11), ("ext", 12)]
    assert asked == [("cpu", 1), ("cpu", 2), ("ext", 2)]
    cache.count(len(hashes), 3)
    assert cache.hit_rate() == 1.0


def test_offloaded_prefixes_save_evicted_blocks_and_load_them_back():
    pool, tier, log = BlockPool(1), PrefixOffloadTier(2), []
    offloaded = OffloadedPrefixes(tier, pool, lambda kind, pairs: log.append((kind, pairs)))
    (b,) = pool.allocate(1)
    pool.register(b, 7, (1, 2))
    pool.release([b])
    pool.allocate(1)  # evicts block b: its copy goes to the tier
    assert log == [("offload", [(b, 0)])] and offloaded.find(0, 7, (1, 2)) == ("cpu", 0)
    pool.release([b])
    assert offloaded.load(0, 7, (1, 2)) == b and pool.lookup(7, (1, 2)) == b
    assert log[-1] == ("onload", [(0, b)]) and tier.num_loaded == 1


def test_connector_lookup_plans_each_missing_save_once():
    stored = {101}
    connector = SimpleNamespace(
        can_load=True,
        can_save=True,
        contains=lambda key: key in stored,
        block_keys=lambda known, tokens, bs, n, salt: [100 + i for i in range(n)],
    )
    log: list = []
    lookup = ConnectorLookup(connector, BlockPool(4), BS, True, lambda k, p: log.append((k, p)))
    req = request("a", [1, 2, 3, 4, 5, 6, 7])
    lookup.plan_saves([SimpleNamespace(request=req, num_new_tokens=7)], {"a": [-1, 2, 3, 0]})
    assert log == [("kv_save", [(3, 102)])]  # block 0 was freed, block 1 is stored already
    find = lookup.tier_for(req, 3)
    assert [find(i, 0, ()) for i in range(3)] == [None, ("ext", 101), None]
    lookup.fork("a", "b")
    lookup.forget("a")
    assert list(lookup.keys) == ["b"]


def register_every_block(cache: PrefixCache, request: Request, table: list[int], start: int):
    """The register before it offered only what is new: every uncached full computed block
    from ``start`` on, every step."""
    hashes = cache.block_hashes(request, request.num_computed_tokens)
    tokens, bs = request.all_token_ids, cache.block_size
    for i in range(start, min(len(hashes), len(table))):
        if not cache.pool.is_cached(table[i]):
            cache.pool.register(table[i], hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=5 * BS),
                     min_size=1, max_size=8),
    tokens=st.lists(st.integers(0, 1), min_size=40, max_size=40),
    num_blocks=st.integers(8, 14),
    mode=st.sampled_from(["recompute", "swap"]),
    window=st.sampled_from([None, 3]),
)  # fmt: skip
# r4's block goes out with it (swap), is taken for r3 (its cached content evicted) and comes
# back as the same block id: it must be offered again
@example(prompts=[[0], [0], [0], [0] * 10, [1]], tokens=[0] * 40, num_blocks=8, mode="swap",
         window=None)  # fmt: skip
def test_register_offers_what_offering_every_block_would(prompts, tokens, num_blocks, mode,
                                                         window):  # fmt: skip
    """Two schedulers on the same requests and tokens, one registering every uncached block
    each step and one only what is new (PrefixCache.register): the pool caches the same
    blocks under the same keys after every step, through preemptions, swaps, window frees
    and evictions."""
    from paged_llm.core.kv.paged import PagedKVCacheManager
    from paged_llm.core.scheduler import Scheduler, SchedulerLimits

    engines = []
    for reference in (False, True):
        kv = PagedKVCacheManager(num_blocks, BS, max_model_len=16, num_cpu_blocks=8,
                                 enable_prefix_caching=True, sliding_window=window)  # fmt: skip
        if reference:
            kv.prefix_cache.register = register_every_block.__get__(kv.prefix_cache)
        sched = Scheduler(kv, SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16,
                                              preemption_mode=mode))  # fmt: skip
        for n, prompt in enumerate(prompts):
            sched.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=4),
                                      max_model_len=16))  # fmt: skip
        engines.append((sched, kv))
    for step, token in enumerate(tokens):
        outs = [sched.schedule(float(step)) for sched, _ in engines]
        assert [[(s.request.request_id, s.block_table) for s in o.scheduled] for o in outs][0] == [
            [(s.request.request_id, s.block_table) for s in o.scheduled] for o in outs
        ][1]
        for (sched, _), out in zip(engines, outs):
            sched.update_from_output(out, {s.request.request_id: [token] for s in out.scheduled
                                           if s.samples}, float(step))  # fmt: skip
        assert engines[0][1].pool._block_key == engines[1][1].pool._block_key
    sched, kv = engines[0]
    event(f"preempted: {sched.num_preemptions_total > 0}, cached: {bool(kv.pool._block_key)}")
