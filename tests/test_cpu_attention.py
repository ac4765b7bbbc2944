"""The native CPU decode kernel (ops/paged_attention/cpu_decode.cpp) and the ``cpu`` backend,
against the torch reference. The kernel is built on first use (about 15 s, then cached)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cache_helpers import paged_setup

from paged_llm.attention.cpu_backend import CpuAttentionBackend
from paged_llm.attention.metadata import build_attention_metadata
from paged_llm.attention.registry import auto_backend_name
from paged_llm.attention.torch_backend import TorchAttentionBackend, store_kv_reference
from paged_llm.ops.paged_attention import cpu_native
from paged_llm.ops.paged_attention.reference import paged_attention_reference
from paged_llm.quant.kv_cache import kv_cache_spec

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def run_kernel(seq_lens, block_size, hq, hkv, head_dim, dtype, seed=0):
    """(kernel output, reference output) for one decode query per sequence; slots that belong
    to no sequence are NaN, so reading past a sequence's end would show."""
    k_cache, v_cache, block_tables, _ = paged_setup(
        seq_lens, block_size, hkv, head_dim, dtype, seed=seed
    )
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # the engine's pool layout
    query = torch.randn(len(seq_lens), hq, head_dim).to(dtype)
    scale = head_dim**-0.5
    expected = paged_attention_reference(
        query, k_cache, v_cache, block_tables, [1] * len(seq_lens), seq_lens, scale
    )
    out = torch.empty_like(query)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cpu_native.paged_decode_cpu(out, query, k_cache, v_cache, block_tables, lens, scale)
    return out, expected


@pytest.mark.parametrize(
    ("block_size", "hq", "hkv", "head_dim", "dtype"),
    [
        (16, 4, 4, 64, torch.float32),  # MHA
        (16, 8, 2, 80, torch.float32),  # GQA 4, head_dim 80
        (1, 8, 1, 128, torch.float32),  # one token per block, GQA 8
        (256, 4, 1, 64, torch.float32),  # one block covers every context
        (8, 8, 8, 128, torch.float16),
        (16, 8, 2, 64, torch.bfloat16),
    ],
)
def test_kernel_matches_reference(block_size, hq, hkv, head_dim, dtype):
    # Ragged lengths: one token, a multiple of the block size, odd lengths over many blocks.
    out, expected = run_kernel([1, 37, 100, 16, 255], block_size, hq, hkv, head_dim, dtype)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_kernel_random_shapes():
    """Random batches, lengths, block sizes and GQA ratios."""
    gen = torch.Generator().manual_seed(1)
    for case in range(12):
        pick = lambda options: options[torch.randint(len(options), (1,), generator=gen).item()]
        block_size = pick([1, 2, 4, 16, 32, 128])
        hkv, group = pick([1, 2, 4]), pick([1, 4, 8])
        head_dim = pick([64, 80, 128])
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        seq_lens = torch.randint(1, 300, (batch,), generator=gen).tolist()
        out, expected = run_kernel(
            seq_lens, block_size, hkv * group, hkv, head_dim, torch.float32, seed=case
        )
        torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize(
    ("seq_lens", "hkv"),
    [([5, 300, 64, 17, 1, 90], 2), ([300], 4), ([300], 1), ([77, 200], 4), ([40, 9, 120], 8)],
)
def test_kernel_same_result_on_any_thread_count(seq_lens, hkv):
    """Each head of each sequence is computed by one thread in a fixed order, whether tasks are
    whole sequences or (fewer sequences than threads) slices of their KV heads: results are
    bitwise equal for any thread count, and match the reference."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):  # 3 and 8 threads on 2 cores: more tasks than KV heads too
            torch.set_num_threads(n)
            out, expected = run_kernel(seq_lens, 16, 2 * hkv, hkv, 64, torch.float32)
            torch.testing.assert_close(out, expected, **TOL[torch.float32])
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_kernel_rejects_bad_arguments():
    k_cache, v_cache, tables, _ = paged_setup([20], 16, 2, 64, torch.float32, poison=False)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    query, lens = torch.randn(1, 4, 64), torch.tensor([20], dtype=torch.int32)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_native.paged_decode_cpu(out, query, k_cache, v_cache, tables.long(), lens, 0.1)
    with pytest.raises(RuntimeError, match="query's dtype"):
        cpu_native.paged_decode_cpu(out.half(), query.half(), k_cache, v_cache, tables, lens, 0.1)
    codes = k_cache.to(torch.int8)
    with pytest.raises(RuntimeError, match="needs k_scale"):
        cpu_native.paged_decode_cpu(out, query, codes, codes, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        half_scales = torch.ones(codes.shape[:3], dtype=torch.float16)
        cpu_native.paged_decode_cpu(
            out, query, codes, codes, tables, lens, 0.1, half_scales, half_scales
        )
    with pytest.raises(RuntimeError, match="contiguous"):
        strided = torch.randn(*k_cache.shape[:3], 128)[..., ::2]  # same shape, not contiguous
        cpu_native.paged_decode_cpu(out, query, strided, v_cache, tables, lens, 0.1)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "block_size"),
    [("int8", torch.float32, 16), ("fp8", torch.float32, 1), ("int8", torch.bfloat16, 8)],
)
def test_kernel_reads_quantized_cache(kv_cache_dtype, dtype, block_size):
    """int8 / fp8 codes with a scale per (token, head): the same attention as the reference
    over the dequantized cache."""
    seq_lens, hq, hkv, d = [1, 33, 200, 16], 8, 2, 64
    spec = kv_cache_spec(kv_cache_dtype, dtype)
    torch.manual_seed(0)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    tables = torch.randperm(num_blocks)[: num_blocks - 2].split(
        [-(-s // block_size) for s in seq_lens]
    )
    meta = build_attention_metadata([1] * 4, seq_lens, [t.tolist() for t in tables], block_size)
    shape = (num_blocks, block_size, hkv, d)
    k_cache, v_cache = torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype)
    k_scale, v_scale = torch.zeros(shape[:3]), torch.zeros(shape[:3])
    # Fill every sequence's context through the store op, as the engine does.
    ctx = build_attention_metadata(seq_lens, seq_lens, [t.tolist() for t in tables], block_size)
    n = sum(seq_lens)
    keys, values = torch.randn(n, hkv, d).to(dtype), torch.randn(n, hkv, d).to(dtype)
    store_kv_reference(keys, values, k_cache, v_cache, ctx.slot_mapping, k_scale, v_scale)
    query = torch.randn(4, hq, d).to(dtype)
    expected = paged_attention_reference(
        query, k_cache, v_cache, meta.block_tables, [1] * 4, seq_lens, 0.125, k_scale, v_scale
    )
    out = torch.empty_like(query)
    cpu_native.paged_decode_cpu(
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, k_scale, v_scale
    )
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_equals_torch_backend(dtype):
    """Decodes (native kernel), a chunk after a cached prefix and a fresh prompt (torch path)."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 8, 2, 64, 16
    query_lens, seq_lens = [1, 1, 1, 5, 23], [17, 1, 140, 40, 23]
    k_cache, v_cache, _, tables = paged_setup(seq_lens, bs, hkv, d, dtype, poison=False)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    meta = build_attention_metadata(query_lens, seq_lens, tables, bs)
    t = sum(query_lens)
    q = torch.randn(t, hq, d).to(dtype)
    k, v = torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, k_ref, v_ref, meta, 0.125)
    out = CpuAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # same stores


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "window", "kv_cache_dtype", "as_rows"),
    [
        ([1, 5, 3, 16, 40], [17, 40, 9, 60, 100], None, None, 4),  # verify-sized, then a prompt
        ([5, 5, 2], [5, 70, 33], None, None, 3),  # no decodes: a verification-only step
        ([1, 4, 30, 6], [30, 50, 100, 20], 12, None, 2),  # a window; from 30 x 100 on: SDPA
        ([1, 5, 3], [17, 40, 9], None, "int8", 3),  # a quantized cache
    ],
)
def test_short_queries_run_as_kernel_rows(query_lens, seq_lens, window, kv_cache_dtype, as_rows):
    """Speculative verifications (a few query tokens) run in the decode kernel, one row per
    token; they equal the torch backend's SDPA path, causal mask and window included."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 8, 2, 64, 8
    k_cache, v_cache, _, tables = paged_setup(seq_lens, bs, hkv, d, torch.float32, poison=False)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    scales: tuple = (None, None)
    if kv_cache_dtype is not None:
        spec, shape = kv_cache_spec(kv_cache_dtype, torch.float32), k_cache.shape
        (k_cache, k_s), (v_cache, v_s) = (
            spec.quantize(c.flatten(0, 1)) for c in (k_cache, v_cache)
        )
        k_cache, v_cache = k_cache.view(shape), v_cache.view(shape)
        scales = (k_s.view(shape[:3]), v_s.view(shape[:3]))
    meta = build_attention_metadata(query_lens, seq_lens, tables, bs)
    t = sum(query_lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    s_ref = tuple(x.clone() if x is not None else None for x in scales)
    backend = CpuAttentionBackend()
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, *scales, sliding_window=window)
    assert backend._kernel_rows(meta)[0] == as_rows  # the leading short queries
    expected = TorchAttentionBackend().forward(
        q, k, v, k_ref, v_ref, meta, 0.125, *s_ref, sliding_window=window
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_cpu_backend_is_the_cpu_default():
    assert auto_backend_name("cpu") == "cpu"  # this machine has a compiler
    assert auto_backend_name("cuda:0") == "triton"
    with pytest.raises(ValueError, match="runs on the CPU"):
        CpuAttentionBackend().check_device(torch.device("cuda"))


def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu_native, "is_available", lambda: False)
    assert auto_backend_name("cpu") == "torch"


def test_cpu_attention_benchmark_writes_json(tmp_path):
    from experiments import cpu_attention
    from paper_repro.common import compose

    cfg = compose("cpu_attention", ["batch=[3]", "context=[40]", "threads=[1]", "repeats=1"])
    result = cpu_attention.write(cfg, tmp_path)
    (row,) = result["results"]
    assert row["native_ms"] > 0 and row["torch_ms"] > 0 and row["read_ms"] > 0
    assert row["max_abs_diff"] < 1e-5  # the two paths agree
    assert result["mode"] == "real" and (tmp_path / "cpu_attention.json").exists()


def test_cpu_attention_benchmark_query_lengths(tmp_path):
    """query_len times kernel rows against SDPA for multi-token queries; the paths agree."""
    from experiments import cpu_attention
    from paper_repro.common import compose

    cfg = compose("cpu_attention", ["batch=[2]", "context=[40]", "threads=[1]", "repeats=1",
                                    "query_len=[3,20]"])  # fmt: skip
    result = cpu_attention.write(cfg, tmp_path)
    assert [r["query_len"] for r in result["results"]] == [3, 20]
    for row in result["results"]:
        assert row["rows_ms"] > 0 and row["sdpa_ms"] > 0
        assert row["max_abs_diff"] < 1e-4


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=12))
def test_runner_order_puts_short_queries_right_after_decodes(query_lens):
    """The runner's row order is a stable sort by query length, so a verification scheduled
    behind a long prompt chunk still lands in the leading run the kernel rows take."""
    from types import SimpleNamespace

    from paged_llm.runner.batch import order_for_backend

    scheduled = [SimpleNamespace(num_new_tokens=q, index=i) for i, q in enumerate(query_lens)]
    ordered = order_for_backend(scheduled)
    assert sorted(s.index for s in ordered) == list(range(len(scheduled)))
    keys = [(s.num_new_tokens, s.index) for s in ordered]
    assert keys == sorted(keys)  # shortest first, the scheduler's order among equals
    backend = CpuAttentionBackend()
    lens = [s.num_new_tokens for s in ordered]
    meta = build_attention_metadata(lens, [q + 7 for q in lens], [[0] * 40] * len(lens), 8)
    short = sum(backend.as_rows(q, q + 7) for q in lens if q <= backend.rows_always_query_len)
    assert backend._kernel_rows(meta)[0] >= short
