"""The prefix cache's CPU tier (``kv_offloading_size``): cached blocks evicted from the device are
copied to CPU memory and copied back when a later prompt starts with them.

The property test drives the real scheduler over random prompts that share prefixes, on small
pools that evict, preempt (by swapping or recomputing) and chunk, and plays every block move on
shadow pools holding the token ids each block's KV was computed from: whenever a request is
scheduled, every block it counts as computed holds exactly its tokens. The engine tests check
greedy outputs against an engine without any cache."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from shadow_pools import BS, run_with_shadow_pools

from paged_llm import LLM, SamplingParams
from paged_llm.core.kv.paged import PagedKVCacheManager
from paged_llm.core.scheduler import SchedulerLimits


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(st.tuples(st.integers(0, 2), st.integers(2, 40), st.integers(1, 8)),
                      min_size=1, max_size=16),
    num_blocks=st.integers(12, 24),
    offload_blocks=st.integers(1, 20),
    mode=st.sampled_from(["recompute", "swap"]),
    chunk=st.sampled_from([None, 6]),
    arrivals=st.integers(1, 4),
    window=st.sampled_from([None, None, 8, 13]),
)  # fmt: skip
def test_every_computed_block_holds_its_tokens(
    requests, num_blocks, offload_blocks, mode, chunk, arrivals, window
):
    """(With a sliding window, blocks behind it are freed and their entries are NULL.)"""
    kv = PagedKVCacheManager(num_blocks, BS, max_model_len=48, enable_prefix_caching=True,
                             num_cpu_blocks=8 if mode == "swap" else 0,
                             offload_blocks=offload_blocks, sliding_window=window)  # fmt: skip
    limits = SchedulerLimits(
        max_num_seqs=3,
        max_num_batched_tokens=chunk or 48,
        enable_chunked_prefill=chunk is not None,
        preemption_mode=mode,
    )
    sched = run_with_shadow_pools(kv, limits, requests, arrivals)
    event(f"blocks copied back from the tier: {'some' if kv.offload.num_loaded else 'none'}")
    event(f"preempted: {'yes' if sched.num_preemptions_total else 'no'}")


def test_offloading_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PagedKVCacheManager(8, BS, 32, offload_blocks=4)
    with pytest.raises(ValueError, match="kv_offloading_size must be >= 0"):
        LLM("tiny", kv_offloading_size=-1.0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM("tiny", max_model_len=64, kv_offloading_size=0.01)


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = {"prompt_token_ids": list(range(10, 74))}  # 16 blocks of 4
OTHERS = [{"prompt_token_ids": [500 + 7 * i + j for j in range(60)]} for i in range(6)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_evicted_prefix_comes_back_from_cpu_memory(mode):
    """A 64-token prompt, then others that evict all its blocks from a 40-block pool: without
    the tier it is computed again; with it, 60 of its tokens are copied back; the tokens are
    the uncached engine's."""
    want = LLM("tiny", block_size=BS).generate([LONG, *OTHERS], GREEDY, use_tqdm=False)
    common = dict(block_size=BS, num_gpu_blocks_override=40, max_model_len=128,
                  enable_prefix_caching=True, preemption_mode=mode, swap_space=0.01)  # fmt: skip
    for size, cached in ((0.0, 0), (0.01, 60)):
        llm = LLM("tiny", kv_offloading_size=size, **common)
        first = llm.generate([LONG], GREEDY, use_tqdm=False)
        # the others run three at a time: a full pool preempts too
        rest = llm.generate(OTHERS, GREEDY, use_tqdm=False)
        again = llm.generate([LONG], GREEDY, use_tqdm=False)[0]
        got = [o.outputs[0].token_ids for o in [*first, *rest]]
        assert got == [o.outputs[0].token_ids for o in want]
        assert again.outputs[0].token_ids == want[0].outputs[0].token_ids
        assert again.num_cached_tokens == cached
        tier = llm.llm_engine.scheduler.kv.offload
        if size:
            assert tier.num_loaded == 15 and tier.num_saved > 15
            assert llm.reset_prefix_cache()  # drops the tier too: new weights, new KV
            assert llm.generate([LONG], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_the_chat_experiment_caches_more_with_the_tier_and_answers_the_same(tmp_path):
    from experiments.kv_offload import write
    from paper_repro.common import compose

    cfg = compose("kv_offload", ["conversations=6", "turns=3", "message=16", "reply=4",
                                 "gpu_blocks=16", "offload_gib=0.01"])  # fmt: skip
    doc = write(cfg, tmp_path)
    runs = doc["engines"]
    assert all(r["same_replies_as_no_cache"] for r in runs.values())
    assert runs["no prefix cache"]["prompt_tokens_cached"] == 0
    device, tier = runs["device prefix cache"], runs["device + CPU tier"]
    assert tier["prompt_tokens_cached"] > device["prompt_tokens_cached"]
    assert tier["blocks_loaded_back"] > 0 and doc["mode"] == "real"
