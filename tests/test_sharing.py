"""Block sharing: parallel sampling, beam search and prefix caching (copy-on-write blocks)."""

import copy
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm import LLM, BeamSearchParams, SamplingParams
from paged_llm.core.kv.paged import PagedKVCacheManager, live_blocks
from paged_llm.core.request import Request

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(5)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids_of(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- allocator invariants with sharing ---------------------------------------------------------
def _req(rid, n_prompt):
    return Request(str(rid), [3] * n_prompt, SamplingParams(max_tokens=40), max_model_len=64)


def _check(kv: PagedKVCacheManager, live):
    refs = [0] * kv.num_blocks
    for r in live:
        for b in live_blocks(kv.get_block_table(r)):
            refs[b] += 1
    assert refs == kv.pool.ref_counts  # reference counts equal the owners; never negative
    assert kv.pool.num_free == sum(c == 0 for c in refs)


def _swap_in_then_one_token_fits(kv, group) -> bool:
    """Try it on a copy: swap the group in and give each member a slot for one more token."""
    kv, group = copy.deepcopy((kv, group))
    try:
        kv.swap_in(group)
    except MemoryError:
        return False
    return all(kv.allocate_slots(r, 1) for r in group)


@pytest.mark.parametrize("window", [None, 5])
@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 30), st.integers(1, 9)), max_size=60)
)
def test_fork_append_free_swap_keep_refcounts(window, ops):
    """With a sliding window too: blocks freed behind the window (NULL entries) are never
    counted, copied, swapped or freed twice."""
    kv = PagedKVCacheManager(
        num_blocks=20, block_size=4, max_model_len=64, num_cpu_blocks=40, sliding_window=window
    )
    live: list[Request] = []
    swapped: list[list[Request]] = []
    next_id = 0
    for op, a, n in ops:
        if op == 0:  # a new sequence computes its prompt
            r = _req(next_id, 1 + a)
            next_id += 1
            if kv.allocate_slots(r, r.num_tokens):
                r.num_computed_tokens = r.num_tokens
                live.append(r)
        elif op == 1 and live:  # fork
            parent = live[a % len(live)]
            child = _req(next_id, parent.num_prompt_tokens)
            next_id += 1
            child.output_token_ids = list(parent.output_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child)
            live.append(child)
        elif op == 2 and live:  # append tokens: shared blocks must be copied first
            r = live[a % len(live)]
            n = min(n, 64 - r.num_tokens - 1)
            if n > 0 and kv.allocate_slots(r, n):
                first = r.num_computed_tokens // kv.block_size
                last = kv.blocks_for(r.num_computed_tokens + n)
                table = kv.get_block_table(r)
                assert all(kv.pool.ref_counts[b] == 1 for b in table[first:last])  # COW
                r.output_token_ids += [4] * n
                r.num_computed_tokens += n
                kv.on_computed(r)  # frees the blocks behind a sliding window
            kv.take_block_ops()
        elif op == 3 and live:  # free
            kv.free(live.pop(a % len(live)))
        elif op == 4:  # swap a group out, or one back in
            if swapped and a % 2:
                group = swapped.pop()
                fits = _swap_in_then_one_token_fits(kv, group)
                assert kv.can_swap_in(group, 1) == fits  # exact: never promises, never starves
                if fits:
                    kv.swap_in(group)
                    assert all(kv.allocate_slots(r, 1) for r in group)
                    kv.take_block_ops()
                    live += group
                else:
                    swapped.append(group)
            elif live:
                group = live[: 1 + a % 3]
                if kv.swap_out(group) is not None:
                    live = live[len(group) :]
                    swapped.append(group)
        _check(kv, live)
    for r in live + [r for g in swapped for r in g]:
        kv.free(r)
    assert kv.pool.num_free == kv.num_blocks and kv.cpu_pool.num_free == kv.cpu_pool.num_blocks


def test_swap_moves_a_shared_block_once():
    kv = PagedKVCacheManager(num_blocks=16, block_size=4, max_model_len=64, num_cpu_blocks=16)
    a = _req("a", 8)
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    b = _req("b", 8)
    b.num_computed_tokens = 8
    kv.fork(a, b)
    mapping = kv.swap_out([a, b])
    assert len(mapping) == 2  # two shared blocks, copied once each
    assert kv.cpu_pool.num_free == 14 and kv.pool.num_free == 16


def test_a_group_that_fills_the_pool_is_swapped_back_in():
    """Three forks of an 8-token prompt, each with one block of its own: 2 shared + 3 = 5
    blocks, the whole pool. The next token writes no shared block, so nothing is copied and
    the group must come back (a margin of one copy per member kept it out forever)."""
    kv = PagedKVCacheManager(num_blocks=5, block_size=4, max_model_len=16, num_cpu_blocks=8)
    parent = _req("p", 8)
    assert kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    group = [parent]
    for i in range(2):
        child = _req(f"c{i}", 8)
        child.num_computed_tokens = 8
        kv.fork(parent, child)
        group.append(child)
    for r in group:  # one own block each: tokens 8..10
        assert kv.allocate_slots(r, 3)
        r.output_token_ids += [4, 4, 4]
        r.num_computed_tokens = 11
    assert kv.pool.num_free == 0
    assert kv.swap_out(group) is not None and kv.pool.num_free == 5
    assert kv.can_swap_in(group, 1)
    kv.swap_in(group)
    assert all(kv.allocate_slots(r, 1) for r in group) and kv.pool.num_free == 0


# ---- engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_llama):
    from tests.test_engine import hf_greedy

    return [hf_greedy(tiny_llama[1], p, 12) for p in PROMPTS]


def test_parallel_sampling_shares_prompt_blocks(tiny_llama, reference):
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12, n=3))
    for out, ref in zip(outs, reference):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == ref for c in out.outputs)  # greedy samples agree
    sp = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=10, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": PROMPTS[4]}, sp)[0]
    b = llm.generate({"prompt_token_ids": PROMPTS[4]}, sp)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the samples differ
    # memory: 4 samples of a 25-token prompt hold fewer blocks than 4 separate requests
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": PROMPTS[4]}, sp)
    engine.step()
    engine.step()  # the samples forked and wrote their own last block
    shared = engine.scheduler.kv.num_blocks - engine.scheduler.kv.num_free_blocks()
    assert shared < 4 * 7  # 7 blocks each without sharing
    engine.abort_request("s")
    assert engine.kv_usage() == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_sampling_under_preemption(tiny_llama, reference, mode):
    llm = LLM(
        str(tiny_llama[0]), block_size=4, max_model_len=64, num_gpu_blocks_override=40,
        preemption_mode=mode, swap_space=0.01,
    )  # fmt: skip
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12, n=2))
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for out, ref in zip(outs, reference):
        assert all(c.token_ids == ref for c in out.outputs)


def test_a_group_that_can_never_fit_together_is_refused_not_preempted_forever(tiny_llama):
    """Samples and beams are preempted together, so all of them must fit the pool at their
    longest (found by the add/step/abort fuzz test: a best_of = 4 request outgrew a 24-block
    pool and was swapped out and back in forever). Groups that fit still finish."""
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, num_gpu_blocks_override=16,
              preemption_mode="swap", swap_space=0.01)  # fmt: skip
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    # 4 samples of 5 + 30 tokens: 4 x 9 blocks > 16 (no credit for sharing the prompt: after a
    # preemption by recomputation each sample recomputes its own blocks)
    for params in (greedy(30, n=4), SamplingParams(best_of=4, max_tokens=30, seed=0)):
        with pytest.raises(ValueError, match="n/best_of"):
            llm.generate([prompt, {"prompt_token_ids": PROMPTS[1]}], params)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[1]}, prompt],
                        BeamSearchParams(beam_width=4, max_tokens=30))  # fmt: skip
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    # 2 samples of 25 tokens: 2 x 7 = 14 <= 16; three such groups preempt each other
    outs = llm.generate([prompt] * 3, greedy(20, n=2))
    assert engine.scheduler.num_preemptions_total > 0
    assert all(len(c.token_ids) == 20 for o in outs for c in o.outputs)
    assert engine.kv_usage() == 0


@pytest.mark.parametrize("policy", ["paged", "orca_oracle"])
def test_a_group_larger_than_max_num_seqs_is_refused(tiny_llama, reference, policy):
    """A group is admitted whole, so more samples or beams than max_num_seqs would wait (or be
    preempted) forever (found by the add/step/abort fuzz test with max_num_seqs = 2 and n = 3,
    whose forked samples were preempted 150 times and never finished)."""
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, num_gpu_blocks_override=64,
              max_num_seqs=2, policy=policy)  # fmt: skip
    prompt = {"prompt_token_ids": PROMPTS[2]}
    for params in (greedy(12, n=3), SamplingParams(n=2, best_of=3, max_tokens=12, seed=0)):
        with pytest.raises(ValueError, match="max_num_seqs"):
            llm.generate([prompt, prompt], params)
    if policy == "paged":
        with pytest.raises(ValueError, match="beam_width.*max_num_seqs"):
            llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=12))
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate([prompt] * 3, greedy(12, n=2))  # groups of 2 take turns
    assert all(c.token_ids == reference[2] for o in outs for c in o.outputs)


def test_parallel_sampling_without_sharing_policy(tiny_llama, reference):
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, num_gpu_blocks_override=64,
              policy="orca_oracle")  # fmt: skip
    outs = llm.generate({"prompt_token_ids": PROMPTS[2]}, greedy(12, n=2))
    assert all(c.token_ids == reference[2] for c in outs[0].outputs)


def hf_beam(model, prompt, width, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, num_beams=width,
            do_sample=False, eos_token_id=None, pad_token_id=0, num_return_sequences=width,
            early_stopping=False, length_penalty=1.0,
        )  # fmt: skip
    return [row[len(prompt) :].tolist() for row in out]


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(tiny_llama, width):
    path, model = tiny_llama
    llm = LLM(str(path), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    prompts = PROMPTS[:3]
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True),
    )
    for prompt, out in zip(prompts, outs):
        ref = hf_beam(model, prompt, width, 8)
        assert out.sequences[0].tokens[len(prompt) :] == ref[0]
        assert len(out.sequences) == width
    assert llm.llm_engine.kv_usage() == 0  # every beam's blocks were released


def test_beam_text_is_the_whole_sequence_as_in_vllm():
    llm = LLM("tiny", cpu_kv_cache_gib=0.01)
    tok = llm.get_tokenizer()
    out = llm.beam_search(["def main():"], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    for seq in out.sequences:
        assert seq.text == tok.decode(seq.tokens)  # vLLM's LLM.beam_search: prompt included
        assert seq.tokens[: len(tok.encode("def main():"))] == tok.encode("def main():")


def test_beam_search_refuses_a_speculating_engine(tiny_llama):
    """Its scheduler gives every decode draft slots that beam steps never fill: such a beam
    search once ran forever (found by a random-engine beam-search fuzz run)."""
    llm = LLM(str(tiny_llama[0]), block_size=8, max_model_len=48, cpu_kv_cache_gib=0.01,
              speculative_config={"method": "ngram", "num_speculative_tokens": 1})  # fmt: skip
    with pytest.raises(ValueError, match="speculative decoding"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[3]}], BeamSearchParams(2, 4))
    assert not llm.llm_engine.has_unfinished_requests()


def test_beam_search_under_preemption(tiny_llama):
    path, model = tiny_llama
    # 28 blocks: the width-3 group of the 25-token prompt may need 3 x 9 (no sharing credit:
    # a recomputed beam recomputes its own blocks)
    llm = LLM(str(path), block_size=4, max_model_len=64, num_gpu_blocks_override=28)
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    prompts = PROMPTS[2:5]
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
    )
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for prompt, out in zip(prompts, outs):
        assert out.sequences[0].tokens[len(prompt) :] == hf_beam(model, prompt, 3, 8)[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prefix_caching_gives_identical_outputs(tiny_llama, reference, mode):
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # three full blocks of 4
    prompts = [shared + p for p in PROMPTS]
    kw = dict(block_size=4, max_model_len=64, num_gpu_blocks_override=48, preemption_mode=mode,
              swap_space=0.01)  # fmt: skip
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    off = ids_of(LLM(str(tiny_llama[0]), **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(12)))  # fmt: skip
    llm = LLM(str(tiny_llama[0]), enable_prefix_caching=True, **kw)
    on = ids_of(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(12)))
    again = ids_of(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(12)))
    assert on == off == again
    kv = llm.llm_engine.scheduler.kv
    assert kv.prefix_hits > 0 and 0 < kv.prefix_cache_hit_rate() <= 1


def test_a_block_half_computed_by_a_chunk_is_not_cached(tiny_llama, reference):
    """Chunked prefill can stop inside a block, which must not enter the prefix cache before
    it is full (found by the random-engine fuzz test: a request aborted after one 1-token
    chunk left its first block registered, and the next request with the same prompt read the
    block's unwritten slot and produced another token)."""
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, num_gpu_blocks_override=32,
              enable_chunked_prefill=True, max_num_batched_tokens=3,
              enable_prefix_caching=True)  # fmt: skip
    engine, prompt = llm.llm_engine, {"prompt_token_ids": PROMPTS[2]}
    kv = engine.scheduler.kv
    engine.add_request("cut", prompt, greedy(12))
    engine.step()  # a 3-token chunk: block 0 holds 3 of its 4 tokens
    first = kv.block_tables["cut"][0]
    assert engine.scheduler.requests["cut"].num_computed_tokens == 3
    assert not kv.pool.is_cached(first)
    engine.step()  # 6 tokens: block 0 is full now, block 1 is not
    assert kv.pool.is_cached(first) and not kv.pool.is_cached(kv.block_tables["cut"][1])
    engine.abort_request("cut")
    assert ids_of(llm.generate(prompt, greedy(12))) == [reference[2]]


def test_fully_cached_prompt_still_computes_a_token(tiny_llama):
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              enable_prefix_caching=True)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(3, 19))}  # exactly four full blocks
    first = llm.generate(prompt, greedy(5))
    engine = llm.llm_engine
    engine.iteration_stats.clear()
    second = llm.generate(prompt, greedy(5))
    assert ids_of(first) == ids_of(second)
    assert (first[0].num_cached_tokens, second[0].num_cached_tokens) == (0, 12)
    assert engine.iteration_stats[0].num_batched_tokens >= 1
    assert engine.iteration_stats[0].num_batched_tokens < 16  # three blocks came from cache


def test_a_request_that_ends_at_its_prefill_leaves_its_blocks_cached(tiny_llama):
    """One-token requests (scoring, vLLM's server-side beam search) finish in the step that
    computed their prompt: their full blocks still join the cache, with the right contents."""
    kw = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    llm = LLM(str(tiny_llama[0]), enable_prefix_caching=True, **kw)
    prompt = list(range(3, 21))  # 18 tokens: four full blocks
    assert llm.generate({"prompt_token_ids": prompt}, greedy(1))[0].num_cached_tokens == 0
    longer = {"prompt_token_ids": prompt + [7, 8, 9]}
    hit = llm.generate(longer, greedy(6))[0]
    assert hit.num_cached_tokens == 16
    cold = LLM(str(tiny_llama[0]), **kw).generate(longer, greedy(6))[0]
    assert ids_of([hit]) == ids_of([cold])


def test_reset_prefix_cache_starts_the_next_run_cold(tiny_llama):
    """vLLM's ``LLM.reset_prefix_cache()``: refused while a request holds blocks, then every
    cached block is forgotten, and the next run computes its whole prompt again."""
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              enable_prefix_caching=True)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(3, 19))}
    first = llm.generate(prompt, greedy(5))
    engine = llm.llm_engine
    engine.add_request("running", prompt, greedy(5))
    engine.step()
    assert not llm.reset_prefix_cache()  # a running request holds (cached) blocks
    engine.abort_request("running")
    assert llm.reset_prefix_cache()
    again = llm.generate(prompt, greedy(5))
    assert ids_of(again) == ids_of(first) and again[0].num_cached_tokens == 0
    assert llm.generate(prompt, greedy(5))[0].num_cached_tokens == 12  # cached again
    assert LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
               policy="orca_oracle").reset_prefix_cache()  # nothing to drop  # fmt: skip


def test_prefix_caching_needs_a_paged_policy(tiny_llama):
    with pytest.raises(ValueError, match="does not take"):
        LLM(str(tiny_llama[0]), policy="orca_max", enable_prefix_caching=True,
            num_gpu_blocks_override=64, max_model_len=64)  # fmt: skip
