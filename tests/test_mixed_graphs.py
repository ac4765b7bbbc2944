"""CUDA graphs for mixed steps (prompt tokens beside decodes; ``cudagraph_mode="FULL"``), as far
as a CPU can check them: the padding, the choice of graph, the configuration, and the exact
padded static-buffer steps replayed eagerly (Triton kernels in the interpreter) against eager
steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from graph_replay import replay_graphs_eagerly

from paged_llm import LLM, SamplingParams
from paged_llm.config import ModelConfig
from paged_llm.runner.cuda_graphs import (
    VARLEN,
    CudaGraphRunner,
    key_tokens,
    mixed_capture_tokens,
    pad_varlen,
)


def batch(query_lens, seq_lens, tables, ids=None):
    """A HostBatch-like batch: each sequence's queries are the last of its context."""
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    return SimpleNamespace(
        input_ids=ids or [7] * len(positions), positions=positions, query_lens=list(query_lens),
        seq_lens=list(seq_lens), block_tables=[list(t) for t in tables],
    )  # fmt: skip


def test_mixed_padding_keeps_rows_writes_nowhere_and_adds_empty_sequences():
    # block size 4: a decode at position 5 (block 9), a 3-token chunk at 0-2 (block 4)
    b = batch([1, 3], [6, 3], [[3, 9], [4]], ids=[11, 12, 13, 14])
    padded = pad_varlen(b, tokens=8, num_seqs=4, block_size=4, width=3)
    assert padded.rows == [0, 1, 2, 3]  # the batch's tokens keep their rows
    assert padded.input_ids == [11, 12, 13, 14, 0, 0, 0, 0]
    assert padded.positions == [5, 0, 1, 2, 0, 0, 0, 0]
    assert padded.slot_mapping == [37, 16, 17, 18, -1, -1, -1, -1]
    assert padded.seq_lens == [6, 3, 0, 0]  # padding sequences: no context
    assert padded.query_start_loc == [0, 1, 4, 4, 4]  # ... and no queries
    assert padded.block_tables.tolist() == [[3, 9], [4, 0]]  # the real rows: padding reads nothing
    with pytest.raises(ValueError, match="at most 3 tokens"):
        pad_varlen(b, tokens=3, num_seqs=4, block_size=4, width=3)
    with pytest.raises(ValueError, match="1 to 1 sequences"):
        pad_varlen(b, tokens=8, num_seqs=1, block_size=4, width=3)
    with pytest.raises(ValueError, match="wider"):
        pad_varlen(b, tokens=8, num_seqs=4, block_size=4, width=1)


def test_mixed_keys_are_chosen_after_decode_and_verification_graphs():
    assert mixed_capture_tokens(64) == [16, 32, 48, 64]
    assert mixed_capture_tokens(40) == [16, 32]
    graphs = CudaGraphRunner(None, None, [], None, [1, 2, 4], 4, 64, torch.device("cpu"),
                             strides=(1, 3), mixed_tokens=[16, 32])  # fmt: skip
    graphs.graphs = dict.fromkeys(graphs.keys)
    assert (32, VARLEN) in graphs.keys and key_tokens((32, VARLEN)) == 32
    assert key_tokens((4, 3)) == 12
    assert graphs.key_for(batch([1, 1, 1], [5, 6, 7], [[0, 1]] * 3)) == (4, 1)  # decode
    assert graphs.key_for(batch([1, 3], [5, 6], [[0, 1]] * 2)) == (2, 3)  # verification
    assert graphs.key_for(batch([1, 9], [5, 9], [[0, 1]] * 2)) == (16, VARLEN)  # a prompt
    assert graphs.key_for(batch([1, 20], [5, 20], [[0, 1]] * 2)) == (32, VARLEN)
    assert graphs.key_for(batch([40], [40], [[0]])) is None  # more tokens than any graph
    assert graphs.key_for(batch([1] * 5, [3] * 5, [[0]] * 5)) is None  # more than 4 sequences
    # the static buffers hold the largest mixed step's tokens
    assert graphs.input_ids.shape == (32,) and graphs.query_start_loc[VARLEN].shape == (5,)


def test_cudagraph_mode_is_checked_and_picks_what_is_captured(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="cudagraph_mode"):
        ModelConfig(cudagraph_mode="PIECEWISE")
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        ModelConfig(max_cudagraph_capture_size=0)
    from paged_llm.engine import worker as worker_module

    captured = {}
    monkeypatch.setattr(worker_module, "cuda_graph_sizes", lambda *a, **k: [1, 2, 4])
    monkeypatch.setattr(
        "paged_llm.runner.model_runner.ModelRunner.capture_cuda_graphs",
        lambda self, sizes, max_len, strides, mixed: captured.update(mixed=mixed),
    )
    kwargs = dict(cpu_kv_cache_gib=0.01, max_model_len=64, max_num_batched_tokens=100)
    LLM(str(tiny_llama[0]), **kwargs)
    assert captured["mixed"] == mixed_capture_tokens(100)  # the step budget caps them
    LLM(str(tiny_llama[0]), max_cudagraph_capture_size=40, **kwargs)
    assert captured["mixed"] == [16, 32]
    LLM(str(tiny_llama[0]), cudagraph_mode="FULL_DECODE_ONLY", **kwargs)
    assert captured["mixed"] == []


def staggered(llm, prompts, params):
    """(token ids, logprobs) of each request, one arriving per step, so prompts meet decodes."""
    engine, done = llm.llm_engine, {}

    def step():
        done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)

    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        step()
    while engine.has_unfinished_requests():
        step()
    return [(done[str(i)].token_ids, done[str(i)].logprobs) for i in range(len(prompts))]


@pytest.mark.parametrize("chunked", [False, True])
def test_mixed_steps_replayed_from_padded_buffers_give_the_same_tokens(
    tiny_llama, chunked, monkeypatch
):
    """Prompts arriving beside decodes (and, chunked, prompt chunks beside decodes) run
    through mixed-step graphs: the same greedy tokens, and their logprobs, as eager steps."""
    prompts = [[5, 9, 17, 33, 2 + i] * (2 * i + 1) for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
        for n in (6, 3, 8, 5)
    ]
    kwargs = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01, max_num_seqs=4,
                  attention_backend="triton", dtype="float32")  # fmt: skip
    if chunked:  # 12-token steps: the 35-token prompt runs in chunks beside decodes
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=12)

    expected = staggered(LLM(str(tiny_llama[0]), **kwargs), prompts, params)
    llm = LLM(str(tiny_llama[0]), **kwargs)
    graphs = replay_graphs_eagerly(llm, monkeypatch, [1, 2, 4], mixed_tokens=[16, 32, 48])
    got = staggered(llm, prompts, params)
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, lp_got), (_, lp_exp) in zip(got, expected):
        for step_got, step_exp in zip(lp_got, lp_exp):
            assert step_got.keys() == step_exp.keys()
            for tok in step_got:
                assert step_got[tok].logprob == pytest.approx(step_exp[tok].logprob, abs=1e-4)
    kinds = llm.llm_engine.runner.forward_kinds
    assert kinds["graph_mixed"] > 0 and kinds["graph"] > 0
    assert "eager_prefill" not in kinds  # every step fits a mixed graph's 48 tokens
    assert {k for k in graphs.replays if k[1] == VARLEN} <= {(16, VARLEN), (32, VARLEN),
                                                              (48, VARLEN)}  # fmt: skip


def test_padding_rows_of_a_mixed_step_come_out_zero():
    """Rows past the last query offset belong to no sequence: the triton backend leaves them
    zero (finite for the layers after), and padding sequences write and read nothing."""
    from paged_llm.attention.metadata import build_attention_metadata
    from paged_llm.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 16, 4
    k_cache, v_cache = torch.randn(2, 6, bs, hkv, d).unbind(0)
    meta = build_attention_metadata([1, 3], [6, 3], [[3, 1], [4]], bs)
    q, k, v = torch.randn(8, hq, d), torch.randn(8, hkv, d), torch.randn(8, hkv, d)
    expected_caches = k_cache.clone(), v_cache.clone()
    expected = TritonAttentionBackend().forward(q[:4], k[:4], v[:4], *expected_caches, meta, 0.25)
    meta.padded_tokens, meta.num_decodes = True, 0  # as _mixed_context builds it
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((4,), -1)])
    meta.query_start_loc = torch.tensor([0, 1, 4, 4], dtype=torch.int32)  # + an empty sequence
    meta.seq_lens = torch.tensor([6, 3, 0], dtype=torch.int32)
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros(1, 2, dtype=torch.int32)])
    meta.seq_lens_cpu = [6, 3, 0]
    caches = k_cache.clone(), v_cache.clone()
    out = TritonAttentionBackend().forward(q, k, v, *caches, meta, 0.25)
    torch.testing.assert_close(out[:4], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4:], torch.zeros(4, hq, d))
    assert all(torch.equal(a, b) for a, b in zip(caches, expected_caches))  # slot -1: unwritten


def test_a_failed_mixed_capture_keeps_the_decode_graphs(monkeypatch):
    graphs = CudaGraphRunner(None, None, [], None, [1, 2], 4, 64, torch.device("cpu"),
                             mixed_tokens=[16, 32])  # fmt: skip

    def capture_one(key, pool):
        if key == (16, VARLEN):
            raise RuntimeError("operation not permitted when stream is capturing")
        graphs.graphs[key], graphs.outputs[key] = "graph", "output"

    monkeypatch.setattr(graphs, "_capture_one", capture_one)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs.capture()
    assert sorted(graphs.graphs) == [(1, 1), (2, 1)]  # the 32-token graph went too
    assert graphs.key_for(batch([1, 9], [5, 9], [[0, 1]] * 2)) is None  # runs eagerly
    assert graphs.key_for(batch([1, 1], [5, 9], [[0, 1]] * 2)) == (2, 1)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_steps_with_prompts_replay_mixed_graphs(tiny_llama, method, monkeypatch):
    """Verifications beside arriving prompts run through the target's mixed graphs (the
    drafter keeps its own graphs): the same greedy tokens as the engine without graphs."""
    prompts = [[5, 9, 17, 33, 2 + i] * (i + 2) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3
    kwargs = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01, max_num_seqs=4,
                  attention_backend="triton", dtype="float32")  # fmt: skip
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":  # the target drafting for itself
        spec["model"] = str(tiny_llama[0])
    expected = staggered(LLM(str(tiny_llama[0]), **kwargs), prompts, params)
    llm = LLM(str(tiny_llama[0]), speculative_config=spec, **kwargs)
    replay_graphs_eagerly(llm, monkeypatch, [1, 2, 4], strides=(1, 4), mixed_tokens=[16, 32])
    got = staggered(llm, prompts, params)
    assert [g[0] for g in got] == [e[0] for e in expected]
    kinds = llm.llm_engine.runner.forward_kinds
    assert kinds["graph_mixed"] > 0 and llm.llm_engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize(
    "engine_args, extra_params",
    [
        ({"kv_cache_dtype": "int8"}, {}),  # a quantized cache: scales stored and read
        ({"enable_prefix_caching": True}, {}),  # second round: queries after cached prefixes
        ({}, {"prompt_logprobs": 2}),  # every prompt row's logits
    ],
    ids=["int8_kv", "prefix_cache", "prompt_logprobs"],
)
def test_mixed_graphs_with_engine_features(tiny_llama, monkeypatch, engine_args, extra_params):
    prompts = [[5, 9, 17, 33, 2 + i] * (2 * i + 2) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, **extra_params)] * 3
    kwargs = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01, max_num_seqs=4,
                  attention_backend="triton", dtype="float32", **engine_args)  # fmt: skip

    def run(llm):
        first = staggered(llm, prompts, params)
        second = [o.prompt_logprobs for o in llm.generate(  # a second round of the same prompts
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
        return first, second

    expected = run(LLM(str(tiny_llama[0]), **kwargs))
    llm = LLM(str(tiny_llama[0]), **kwargs)
    replay_graphs_eagerly(llm, monkeypatch, [1, 2, 4], mixed_tokens=[16, 32, 48, 64])
    got = run(llm)
    assert [g[0] for g in got[0]] == [e[0] for e in expected[0]]
    assert all((e is not None) == bool(extra_params) for e in expected[1])
    for prompt_got, prompt_exp in zip(got[1], expected[1]):
        if prompt_exp is None:
            assert prompt_got is None
            continue
        for row_got, row_exp in zip(prompt_got[1:], prompt_exp[1:]):
            assert row_got.keys() == row_exp.keys()
            assert all(abs(row_got[t].logprob - row_exp[t].logprob) < 1e-4 for t in row_got)
    assert llm.llm_engine.runner.forward_kinds["graph_mixed"] > 0
    if engine_args.get("enable_prefix_caching"):
        assert llm.llm_engine.scheduler.kv.prefix_hits > 0


def test_embeddings_through_mixed_graphs_equal_eager_ones(tiny_llama, monkeypatch):
    """A pooling model's prompt steps replay mixed graphs: the same embeddings."""
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 2 + i] * (i + 2)} for i in range(3)]
    kwargs = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01, max_num_seqs=4,
                  attention_backend="triton", dtype="float32", runner="pooling",
                  pooler_config={"pooling_type": "MEAN"})  # fmt: skip
    expected = LLM(str(tiny_llama[0]), **kwargs).embed(prompts, use_tqdm=False)
    llm = LLM(str(tiny_llama[0]), **kwargs)
    replay_graphs_eagerly(llm, monkeypatch, [1, 2, 4], mixed_tokens=[16, 32, 48])
    got = llm.embed(prompts, use_tqdm=False)
    for g, e in zip(got, expected):
        g_emb, e_emb = torch.tensor(g.outputs.embedding), torch.tensor(e.outputs.embedding)
        torch.testing.assert_close(g_emb, e_emb, rtol=1e-5, atol=1e-5)
    assert llm.llm_engine.runner.forward_kinds["graph_mixed"] > 0
