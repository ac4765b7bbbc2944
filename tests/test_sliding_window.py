"""Sliding-window attention (Mistral v0.1, Qwen2/3 with ``use_sliding_window``): the reference
mask against a per-query loop, every backend and kernel against the reference, and the engine's
greedy output against transformers' ``generate`` on a tiny Mistral whose window is shorter
than its prompts. Model-level logits parity is in ``test_models.py`` (the "*-sliding" cases)."""

import itertools

import pytest
import torch
from paged_cache_helpers import paged_setup
from test_engine import generate_ids, hf_greedy

from paged_llm import LLM, SamplingParams
from paged_llm.attention.contiguous_backend import ContiguousAttentionBackend
from paged_llm.attention.cpu_backend import CpuAttentionBackend
from paged_llm.attention.metadata import build_attention_metadata
from paged_llm.attention.torch_backend import TorchAttentionBackend, store_kv_reference
from paged_llm.attention.triton_backend import TritonAttentionBackend
from paged_llm.core.kv.paged import live_blocks
from paged_llm.ops.paged_attention import cpu_native
from paged_llm.ops.paged_attention.reference import (
    attention_mask,
    paged_attention_reference,
    paged_decode_attention_batched,
)
from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton
from paged_llm.ops.paged_attention.triton_prefill import paged_prefill_attention_triton
from paged_llm.quant.kv_cache import kv_cache_spec

TOL = dict(atol=1e-5, rtol=1e-4)
# Decodes first, then a chunk after a cached prefix, a fresh prompt and a one-token context.
QUERY_LENS = [1, 1, 1, 7, 23, 1]
SEQ_LENS = [17, 1, 70, 40, 23, 1]
WINDOWS = [1, 3, 4, 9, 30, 1000]  # one token, under / at / over a block, longer than any context


def test_attention_mask_is_the_transformers_rule():
    # transformers' sliding_window_overlay: kv_idx > q_idx - W, on top of causality.
    mask = attention_mask(3, 6, 2)
    expected = [[q - 2 < k <= q for k in range(6)] for q in (3, 4, 5)]
    assert mask.tolist() == expected
    assert attention_mask(2, 4, None).tolist() == [[True] * 3 + [False], [True] * 4]


@pytest.mark.parametrize("window", [1, 5, 64])
def test_reference_equals_attention_over_each_querys_own_window(window):
    """The reference with a window == plain softmax attention of each query over exactly the
    positions p - W + 1 ... p, computed one query at a time."""
    hq, hkv, d, bs = 4, 2, 16, 4
    k_cache, v_cache, block_tables, tables = paged_setup(SEQ_LENS, bs, hkv, d, torch.float32)
    query = torch.randn(sum(QUERY_LENS), hq, d)
    out = paged_attention_reference(
        query, k_cache, v_cache, block_tables, QUERY_LENS, SEQ_LENS, 0.25, sliding_window=window
    )
    row = 0
    for table, q_len, s_len in zip(tables, QUERY_LENS, SEQ_LENS):
        slots = [table[p // bs] * bs + p % bs for p in range(s_len)]
        keys = k_cache.flatten(0, 1)[slots].repeat_interleave(hq // hkv, dim=1)  # [S, Hq, D]
        values = v_cache.flatten(0, 1)[slots].repeat_interleave(hq // hkv, dim=1)
        for p in range(s_len - q_len, s_len):
            seen = slice(max(0, p - window + 1), p + 1)
            scores = torch.einsum("hd,khd->hk", query[row], keys[seen]) * 0.25
            expected = torch.einsum("hk,khd->hd", scores.softmax(-1), values[seen])
            torch.testing.assert_close(out[row], expected, **TOL)
            row += 1


@pytest.mark.parametrize("window", [1, 6, 1000])
def test_batched_decode_reference_takes_the_window(window):
    seq_lens = [1, 9, 30]
    k_cache, v_cache, tables, _ = paged_setup(seq_lens, 4, 2, 16, torch.float32, poison=False)
    query = torch.randn(3, 4, 16)
    expected = paged_attention_reference(
        query, k_cache, v_cache, tables, [1] * 3, seq_lens, 0.25, sliding_window=window
    )
    out = paged_decode_attention_batched(
        query, k_cache, v_cache, tables, torch.tensor(seq_lens), 0.25, sliding_window=window
    )
    torch.testing.assert_close(out, expected, **TOL)


def poison_outside_windows(k_cache, v_cache, tables, query_lens, seq_lens, window, bs):
    """NaN in every block that lies wholly before its sequence's first query's window: no
    backend may read those (the engine may hand them to other requests)."""
    for table, q_len, s_len in zip(tables, query_lens, seq_lens):
        first_seen = max(0, s_len - q_len - window + 1)
        for block in table[: first_seen // bs]:
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")


def backend_case(name, bs, window, dtype=torch.float32, contiguous_tables=False):
    """(backend output, reference output) for one mixed step of QUERY_LENS / SEQ_LENS."""
    torch.manual_seed(0)
    hq, hkv, d = 8, 2, 32
    k_cache, v_cache, _, tables = paged_setup(SEQ_LENS, bs, hkv, d, dtype, poison=False)
    if contiguous_tables:  # the contiguous backend reads each sequence as one run of slots
        runs = itertools.accumulate([0] + [len(t) for t in tables])
        tables = [list(range(start, start + len(t))) for start, t in zip(runs, tables)]
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()  # the reference reads every position
    poison_outside_windows(k_cache, v_cache, tables, QUERY_LENS, SEQ_LENS, window, bs)
    meta = build_attention_metadata(QUERY_LENS, SEQ_LENS, tables, bs)
    t = sum(QUERY_LENS)
    q = torch.randn(t, hq, d).to(dtype)
    k, v = torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype)
    store_kv_reference(k, v, k_ref, v_ref, meta.slot_mapping)
    expected = paged_attention_reference(
        q, k_ref, v_ref, meta.block_tables, QUERY_LENS, SEQ_LENS, 0.125, sliding_window=window
    )
    backend = {
        "torch": TorchAttentionBackend,
        "cpu": CpuAttentionBackend,
        "contiguous": ContiguousAttentionBackend,
        "triton": TritonAttentionBackend,
    }[name]()
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, sliding_window=window)
    return out, expected


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_cpu_side_backends_match_reference(name, window, bs):
    out, expected = backend_case(name, bs, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("window", [3, 9, 1000])
def test_contiguous_backend_matches_reference(window):
    out, expected = backend_case("contiguous", 4, window, contiguous_tables=True)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize(("window", "bs"), [(1, 4), (9, 4), (30, 1), (4, 16)])
def test_triton_backend_matches_reference(window, bs):
    out, expected = backend_case("triton", bs, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize(("window", "num_splits"), [(20, 3), (37, 2), (5, 4)])
def test_triton_decode_splits_only_the_window(window, num_splits):
    """Split-K partitions the window's tiles; splits left empty must not disturb the merge."""
    seq_lens = [100, 37, 3]
    k_cache, v_cache, tables, _ = paged_setup(seq_lens, 16, 2, 64, torch.float32)
    query = torch.randn(3, 4, 64)
    expected = paged_attention_reference(
        query, k_cache, v_cache, tables, [1] * 3, seq_lens, 0.125, sliding_window=window
    )
    out = paged_decode_attention_triton(
        query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.125,
        num_splits=num_splits, block_n=16, sliding_window=window,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (64, 32)])
def test_triton_prefill_window_across_query_tiles(block_m, block_n):
    """A 70-token prompt spans several query blocks (4 or 16 tokens x the 4 heads of the
    group), each starting its keys at its own window; the window (21) is not a multiple of
    the tiles. A padding sequence and two padding rows follow, and are left alone."""
    query_lens, seq_lens = [70, 5], [70, 50]
    k_cache, v_cache, tables, _ = paged_setup(seq_lens, 8, 1, 32, torch.float16)
    query = torch.randn(77, 4, 32).half()
    expected = paged_attention_reference(
        query[:75], k_cache, v_cache, tables, query_lens, seq_lens, 0.2, sliding_window=21
    )
    out = torch.zeros_like(query)
    paged_prefill_attention_triton(
        query, k_cache, v_cache, torch.cat([tables, tables[:1]]),
        torch.tensor([0, 70, 75, 75], dtype=torch.int32),
        torch.tensor([*seq_lens, 0], dtype=torch.int32), 0.2, block_m=block_m, block_n=block_n,
        out=out, sliding_window=21,
    )  # fmt: skip
    torch.testing.assert_close(out[:75], expected, atol=3e-3, rtol=3e-3)
    assert not out[75:].any()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_native_cpu_kernel_window_over_a_quantized_cache(kv_cache_dtype):
    seq_lens, bs, hkv, d = [1, 33, 200], 8, 2, 64
    spec = kv_cache_spec(kv_cache_dtype, torch.float32)
    num_blocks = sum(-(-s // bs) for s in seq_lens)
    tables = torch.randperm(num_blocks).split([-(-s // bs) for s in seq_lens])
    tables = [t.tolist() for t in tables]
    shape = (num_blocks, bs, hkv, d)
    k_cache, v_cache = torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype)
    k_scale, v_scale = torch.zeros(shape[:3]), torch.zeros(shape[:3])
    ctx = build_attention_metadata(seq_lens, seq_lens, tables, bs)
    n = sum(seq_lens)
    store_kv_reference(
        torch.randn(n, hkv, d), torch.randn(n, hkv, d), k_cache, v_cache, ctx.slot_mapping,
        k_scale, v_scale,
    )  # fmt: skip
    meta = build_attention_metadata([1] * 3, seq_lens, tables, bs)
    query = torch.randn(3, 8, d)
    expected = paged_attention_reference(
        query, k_cache, v_cache, meta.block_tables, [1] * 3, seq_lens, 0.125, k_scale, v_scale,
        sliding_window=50,
    )  # fmt: skip
    out = torch.empty_like(query)
    cpu_native.paged_decode_cpu(
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, k_scale, v_scale,
        sliding_window=50,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **TOL)


def test_bad_windows_are_refused():
    from paged_llm.layers.attention import PagedAttention

    with pytest.raises(ValueError, match="sliding_window"):
        PagedAttention(4, 2, 16, 0.25, 0, sliding_window=0)
    k_cache, v_cache, tables, _ = paged_setup([5], 4, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention_triton(
            torch.randn(1, 1, 16), k_cache, v_cache, tables, torch.tensor([5]).int(), 0.25,
            sliding_window=-3,
        )  # fmt: skip


# ------------------------------------------------------------------------ engine

PROMPTS = [[5, 9, 17, 33, 2 + i] * (2 * i + 1) for i in range(4)]  # 5..35 tokens
NEW_TOKENS = 16
WINDOW = 8  # shorter than every prompt but the first; decodes run far past it


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    """(directory, transformers reference outputs) of a tiny Mistral with an 8-token window."""
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny-mistral-sliding")
    cfg = tf.MistralConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
        initializer_range=0.2, sliding_window=WINDOW,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    reference = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    # The window must change the answer, or these tests would not test it.
    cfg.sliding_window = None
    unwindowed = tf.MistralForCausalLM(cfg).eval()
    unwindowed.load_state_dict(model.state_dict())
    assert [hf_greedy(unwindowed, p, NEW_TOKENS) for p in PROMPTS] != reference
    return path, reference


@pytest.mark.parametrize(
    "options",
    [
        dict(attention_backend="torch", block_size=4),
        dict(attention_backend="cpu", block_size=16),
        dict(attention_backend="cpu", block_size=1, enable_chunked_prefill=True,
             max_num_batched_tokens=16),
        dict(attention_backend="torch", block_size=4, enable_prefix_caching=True),
        dict(attention_backend="contiguous", policy="orca_max", block_size=4,
             num_gpu_blocks_override=64),
        dict(attention_backend="triton", block_size=8),
    ],
    ids=["torch", "cpu", "cpu-chunked", "prefix-caching", "contiguous", "triton"],
)  # fmt: skip
def test_engine_greedy_matches_transformers(tiny_mistral, options):
    path, reference = tiny_mistral
    llm = LLM(str(path), max_model_len=128, cpu_kv_cache_gib=0.01, **options)
    assert generate_ids(llm, PROMPTS, NEW_TOKENS) == reference
    if options.get("enable_prefix_caching"):  # a second pass reads the cached prompt blocks
        # (only those of each prompt's last window are taken: earlier hits are skipped)
        assert generate_ids(llm, PROMPTS, NEW_TOKENS) == reference
        assert llm.llm_engine.scheduler.kv.prefix_hits >= 8


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_runs_past_the_window_under_preemption(tiny_mistral, mode):
    """24 requests in an 11-block pool: sequences whose early blocks were freed are swapped
    out and back, or recomputed, and still give transformers' tokens."""
    path, _ = tiny_mistral
    prompts = [[5, 9, 17, 33, 2 + i] * (1 + i % 4) for i in range(24)]
    llm = LLM(
        str(path), block_size=4, num_gpu_blocks_override=11, max_model_len=44,
        preemption_mode=mode, swap_space=0.01,
    )  # fmt: skip
    expected = [hf_greedy(tf_model(path), p, 24) for p in prompts]
    assert generate_ids(llm, prompts, 24) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_requests_longer_than_the_pool_run_with_chunked_prefill(tiny_mistral, mode):
    """An 8-block pool (32 slots) and requests of up to 51 tokens: with chunked prefill
    (8 tokens a step) each holds at most its window plus one chunk, so all of them run and
    give transformers' tokens; without chunking a prompt's whole prefill must fit, which the
    engine refuses up front."""
    path, reference = tiny_mistral
    common = dict(block_size=4, num_gpu_blocks_override=8, max_model_len=64)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(path), **common)
    llm = LLM(str(path), enable_chunked_prefill=True, max_num_batched_tokens=8,
              preemption_mode=mode, swap_space=0.01, **common)  # fmt: skip
    assert max(map(len, PROMPTS)) + NEW_TOKENS > llm.llm_engine.scheduler.kv.num_slots
    assert generate_ids(llm, PROMPTS, NEW_TOKENS) == reference
    assert llm.llm_engine.kv_usage() == 0


def tf_model(path):
    """The saved tiny Mistral, loaded by transformers."""
    import transformers as tf

    return tf.MistralForCausalLM.from_pretrained(str(path)).eval()


def test_blocks_behind_the_window_go_back_to_the_pool(tiny_mistral):
    """While decoding, a sequence holds only the blocks of its last W + 1 positions (at most
    ceil((W + 1) / block_size) + 1 of them), whatever its length; the rest are free."""
    path, reference = tiny_mistral
    llm = LLM(str(path), block_size=4, max_model_len=128)
    engine, kv = llm.llm_engine, llm.llm_engine.scheduler.kv
    assert kv.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    most, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        for r in engine.scheduler.running:
            if r.num_output_tokens:
                held = live_blocks(kv.get_block_table(r))
                most = max(most, len(held))
                assert len(held) <= -(-(WINDOW + 1) // 4) + 1
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == reference
    assert most >= 3  # the bound was reached, not trivially met
    assert kv.num_free_blocks() == kv.num_blocks


def test_a_draft_model_keeps_every_block(tiny_mistral):
    """A draft model reads the same block tables with its own (full) attention, so nothing is
    freed behind the target's window then."""
    path, _ = tiny_mistral
    llm = LLM(str(path), block_size=4, max_model_len=128,
              speculative_config={"method": "draft_model", "model": str(path),
                                  "num_speculative_tokens": 2})  # fmt: skip
    assert llm.llm_engine.scheduler.kv.sliding_window is None
    ngram = LLM(str(path), block_size=4, max_model_len=128,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
    assert ngram.llm_engine.scheduler.kv.sliding_window == WINDOW


def test_parallel_samples_and_beams_share_blocks_past_the_window(tiny_mistral):
    """Forked samples and beams share, copy and free windowed tables: greedy samples equal
    transformers' greedy output, and the best beam equals transformers' beam search."""
    from test_sharing import hf_beam

    from paged_llm import BeamSearchParams

    path, reference = tiny_mistral
    llm = LLM(str(path), block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, ref in zip(outs, reference):
        assert [c.token_ids for c in out.outputs] == [ref] * 3
    prompts = PROMPTS[1:3]
    beams = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True),
    )
    model = tf_model(path)
    for prompt, out in zip(prompts, beams):
        assert out.sequences[0].tokens[len(prompt) :] == hf_beam(model, prompt, 3, 12)[0]
    assert llm.llm_engine.kv_usage() == 0


def test_sliding_window_benchmark_writes_json(tmp_path):
    from experiments import sliding_window_bench
    from paper_repro.common import compose

    cfg = compose("sliding_window_bench", ["requests=3", "prompt_len=12", "output_len=20",
                  "window=8", "num_blocks=12", "block_size=4", "repeats=1"])  # fmt: skip
    doc = sliding_window_bench.write(cfg, tmp_path)
    assert doc["mode"] == "real" and doc["identical_tokens"]
    free, keep = doc["systems"]["free_behind_window"], doc["systems"]["keep_all_blocks"]
    assert free["max_blocks_per_decoding_seq"] <= -(-(8 + 1) // 4) + 1
    assert keep["max_blocks_per_decoding_seq"] == -(-(12 + 20 - 1) // 4)  # every block kept
    assert (tmp_path / "sliding_window_bench.json").is_file()


def test_prefix_cache_hits_before_the_window_are_skipped():
    """A cached 40-token prompt (10 blocks of 4) with an 8-token window: a repeat computes
    from token 36 (its last token must run) and takes only the hits its first query can see;
    the earlier ones stay cached and untaken, their table entries NULL."""
    from paged_llm.core.kv.paged import NULL_BLOCK, PagedKVCacheManager
    from paged_llm.core.request import Request

    kv = PagedKVCacheManager(16, 4, 64, enable_prefix_caching=True, sliding_window=8)
    prompt = list(range(3, 43))
    first = Request("a", prompt, SamplingParams(max_tokens=1), max_model_len=64)
    assert kv.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    kv.on_computed(first)  # registers its 10 full blocks, frees those behind the window
    kv.free(first)
    again = Request("b", prompt, SamplingParams(max_tokens=1), max_model_len=64)
    kv.prepare_admission(again)
    table = kv.get_block_table(again)
    assert again.num_computed_tokens == 36  # 9 full blocks hit; the 10th holds the last token
    assert table[:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in table[7:]  # (36 - 8) // 4 = 7
    assert sum(kv.pool.ref_counts) == 2  # only the two hits inside the window were taken
    kv.cancel_admission(again)
    assert sum(kv.pool.ref_counts) == 0 and again.num_computed_tokens == 0


def test_a_window_hit_needs_only_the_blocks_its_first_query_reads():
    """vLLM's sliding-window rule: a repeat finds its window's blocks even after the prompt's
    first blocks were evicted (they fell behind the window first, so they are the oldest);
    a full-attention lookup would stop at the missing first block."""
    from paged_llm.core.kv.paged import NULL_BLOCK, PagedKVCacheManager
    from paged_llm.core.request import Request

    kv = PagedKVCacheManager(16, 4, 64, enable_prefix_caching=True, sliding_window=8)
    prompt = list(range(3, 43))
    first = Request("a", prompt, SamplingParams(max_tokens=1), max_model_len=64)
    assert kv.allocate_slots(first, 40)
    for computed in (20, 40):  # two chunks: blocks 0-2 fall behind the window, then 3-7
        first.num_computed_tokens = computed
        kv.on_computed(first)
    kv.free(first)
    filler = Request("f", list(range(100, 136)), SamplingParams(max_tokens=1), max_model_len=64)
    assert kv.allocate_slots(filler, 36)  # 9 blocks: the 6 never used, then 3 evicted
    kv.free(filler)
    first_block = kv.prefix_cache.block_hashes(
        Request("h", prompt, SamplingParams(), max_model_len=64), 4
    )
    assert kv.pool.lookup(first_block[0], tuple(prompt[:4])) is None  # evicted
    again = Request("b", prompt, SamplingParams(max_tokens=1), max_model_len=64)
    kv.prepare_admission(again)
    assert again.num_computed_tokens == 36 and again.num_cached_tokens == 36
    table = kv.get_block_table(again)
    assert table[:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in table[7:9]
    assert sum(kv.pool.ref_counts) == 2  # the two blocks the first query reads
    kv.cancel_admission(again)
    assert sum(kv.pool.ref_counts) == 0
