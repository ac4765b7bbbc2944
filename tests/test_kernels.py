"""Triton kernels against their torch references (run on the CPU via TRITON_INTERPRET=1).

The interpreter is slow, so shapes are tiny; tile sizes are forced down to 16 so that even
~100-token contexts span several tiles, splits and blocks. The wide sweep is marked slow.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first Triton kernel import

import itertools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from paged_cache_helpers import paged_setup, random_cache  # noqa: E402

from paged_llm.attention.metadata import build_attention_metadata  # noqa: E402
from paged_llm.attention.torch_backend import (
    TorchAttentionBackend,  # noqa: E402
    store_kv_reference,  # noqa: E402
)
from paged_llm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from paged_llm.ops.copy_blocks import copy_blocks  # noqa: E402
from paged_llm.ops.copy_blocks.reference import copy_blocks_reference  # noqa: E402
from paged_llm.ops.copy_blocks.triton import copy_blocks_triton  # noqa: E402
from paged_llm.ops.kv_store.triton import store_kv_triton  # noqa: E402
from paged_llm.ops.paged_attention.reference import paged_attention_reference  # noqa: E402
from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton  # noqa: E402
from paged_llm.ops.paged_attention.triton_prefill import (  # noqa: E402
    paged_prefill_attention_triton,
    prefill_grid,
    query_block,
)
from paged_llm.quant.kv_cache import KV_CACHE_DTYPES  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


# ---------------------------------------------------------------- KV store


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype"),
    [
        (1, 2, 64, torch.float32),
        (16, 3, 80, torch.float32),  # non-power-of-two heads and head_dim
        (256, 1, 128, torch.float16),
    ],
)
def test_store_kv_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    torch.manual_seed(0)
    num_blocks, num_tokens = max(4, 32 // block_size), 12
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens must be skipped
    key = torch.randn(num_tokens, num_kv_heads, head_dim)  # fp32, cast on store
    value = torch.randn(num_tokens, head_dim, num_kv_heads).transpose(1, 2)  # non-contiguous
    k_ref = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    v_ref = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_tri = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, strided=True)
    v_tri = v_ref.clone()
    k_tri.copy_(k_ref)

    store_kv_reference(key, value, k_ref, v_ref, slots)
    store_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref)
    assert torch.equal(v_tri, v_ref)


def test_store_kv_skips_all_padding():
    k_cache = torch.zeros(2, 4, 1, 16)
    v_cache = torch.zeros(2, 4, 1, 16)
    kv = torch.ones(3, 1, 16)
    store_kv_triton(kv, kv, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()


# ---------------------------------------------------------------- decode


def check_decode(seq_lens, block_size, hq, hkv, head_dim, dtype, num_splits, block_n=16):
    """Decode kernel == reference attention of one query over each sequence's context."""
    k_cache, v_cache, block_tables, _ = paged_setup(seq_lens, block_size, hkv, head_dim, dtype)
    query = torch.randn(len(seq_lens), hq, head_dim).to(dtype)
    scale = head_dim**-0.5
    expected = paged_attention_reference(
        query, k_cache, v_cache, block_tables, [1] * len(seq_lens), seq_lens, scale
    )
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention_triton(
        query, k_cache, v_cache, block_tables, seq_lens_t, scale,
        num_splits=num_splits, block_n=block_n,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize(
    ("block_size", "hq", "hkv", "head_dim", "dtype", "num_splits"),
    [
        (16, 4, 4, 64, torch.float32, 1),  # MHA
        (16, 8, 2, 80, torch.float32, 3),  # GQA 4, padded head_dim, split-K
        (1, 8, 1, 128, torch.float32, 1),  # one token per block, GQA 8
        (128, 4, 1, 64, torch.float32, 2),  # one block covers most contexts
        (256, 2, 2, 80, torch.float32, 1),
        (16, 8, 2, 128, torch.float16, 2),
        (16, 4, 1, 64, torch.bfloat16, 1),  # interpreter path upcasts bf16 before tl.dot
    ],
)
def test_decode_matches_reference(block_size, hq, hkv, head_dim, dtype, num_splits):
    # Ragged lengths: a single token, a multiple of 16, odd lengths spanning several tiles.
    check_decode([1, 37, 100, 16], block_size, hq, hkv, head_dim, dtype, num_splits)


def test_decode_more_splits_than_tiles():
    # Most splits of these short sequences are empty and must not disturb the reduction.
    check_decode([3, 20], 16, 4, 2, 64, torch.float32, num_splits=8)


def test_decode_default_tiles():
    check_decode([5, 70], 16, 4, 2, 64, torch.float32, num_splits=None, block_n=None)


# ---------------------------------------------------------------- prefill


def check_prefill(
    query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype, tile=16, block_n=None,
    pad_seqs=0, pad_tokens=0, kv=None, sliding_window=None, seed=0,
):  # fmt: skip
    """Prefill kernel == reference causal attention of each sequence's last query_len tokens.

    ``pad_seqs`` sequences with no queries and no context follow the real ones (as a CUDA
    graph's padded step has them) and ``pad_tokens`` query rows follow the last sequence's:
    those rows of a pre-filled ``out`` must stay as they were. ``kv`` quantizes the caches
    (int8 / fp8_e4m3); slots no sequence owns keep NaN scales, so reading one shows."""
    k_cache, v_cache, tables, _ = paged_setup(seq_lens, block_size, hkv, head_dim, dtype, seed=seed)
    scales = {}
    if kv:
        spec = KV_CACHE_DTYPES[kv]
        owned = ~k_cache[..., 0].isnan()  # [num_blocks, block_size, Hkv]
        (k_cache, k_scale), (v_cache, v_scale) = (
            (codes.view(c.shape), s.view(c.shape[:3]).masked_fill(~owned, float("nan")))
            for c in (k_cache, v_cache)
            for codes, s in [spec.quantize(c.nan_to_num().flatten(0, 1))]
        )
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    num_real = sum(query_lens)
    query = torch.randn(num_real + pad_tokens, hq, head_dim).to(dtype)
    scale = head_dim**-0.5
    expected = paged_attention_reference(
        query[:num_real], k_cache, v_cache, tables, query_lens, seq_lens, scale,
        sliding_window=sliding_window, **scales,
    )  # fmt: skip
    starts = [0, *itertools.accumulate(query_lens)] + [num_real] * pad_seqs
    lens = list(seq_lens) + [0] * pad_seqs
    tables = torch.cat([tables, tables.new_zeros(pad_seqs, tables.shape[1])])
    out = torch.full_like(query, 7.0)  # a sentinel the padding rows must keep
    result = paged_prefill_attention_triton(
        query, k_cache, v_cache, tables, torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), scale,
        block_m=tile, block_n=block_n or tile, out=out, sliding_window=sliding_window, **scales,
    )  # fmt: skip
    assert result is out
    torch.testing.assert_close(out[:num_real], expected, **TOL[dtype])
    assert (out[num_real:] == 7.0).all(), "padding rows were written"


PREFILL_SHAPES = {
    "pure": ([20, 1, 45], [20, 1, 45]),  # query == whole context
    "prefix": ([17, 1, 5, 33], [50, 33, 70, 33]),  # cached prefix / chunked prefill / decode
}


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
@pytest.mark.parametrize(
    ("block_size", "hq", "hkv", "head_dim", "dtype"),
    [
        (16, 4, 4, 64, torch.float32),
        (1, 8, 2, 80, torch.float32),
        (128, 8, 1, 128, torch.float32),
        (16, 4, 1, 80, torch.float16),
    ],
)
def test_prefill_matches_reference(shape, block_size, hq, hkv, head_dim, dtype):
    query_lens, seq_lens = PREFILL_SHAPES[shape]
    check_prefill(query_lens, seq_lens, block_size, hq, hkv, head_dim, dtype)


# Decodes among prefills, a chunk after a prefix, queries that straddle 16-wide tiles and
# 8-token blocks (17, 33), a prefix that ends mid-block.
MIXED = ([1, 17, 1, 33, 6], [9, 17, 40, 47, 21])


@pytest.mark.parametrize(
    ("hq", "hkv", "head_dim", "dtype", "tile", "block_n"),
    [
        (2, 2, 64, torch.float32, 16, 16),  # G = 1
        (4, 2, 80, torch.float16, 16, 32),  # G = 2, head_dim padded to 128
        (8, 2, 48, torch.float32, 32, 16),  # G = 4, 8 tokens per program
        (6, 2, 64, torch.float16, 16, 16),  # G = 3: 5 tokens x 3 heads, row 16 masked
        (6, 2, 48, torch.float32, 64, 64),  # G = 3: 21 tokens x 3 heads of 64 rows
        (20, 1, 16, torch.float32, 16, 16),  # G = 20 > block_m: 32 rows, one token each
    ],
)
def test_prefill_varlen_gqa_with_padding(hq, hkv, head_dim, dtype, tile, block_n):
    check_prefill(*MIXED, 8, hq, hkv, head_dim, dtype, tile=tile, block_n=block_n,
                  pad_seqs=2, pad_tokens=5)  # fmt: skip


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_prefill_quantized_cache(kv):
    check_prefill(*MIXED, 8, 6, 2, 32, torch.float32, kv=kv, pad_seqs=1, pad_tokens=3)


def test_prefill_sliding_window_gqa_with_padding():
    check_prefill(*MIXED, 8, 6, 2, 32, torch.float16, sliding_window=11, pad_seqs=1,
                  pad_tokens=2)  # fmt: skip


def test_prefill_bf16_and_default_tiles():
    check_prefill([7, 40], [30, 40], 16, 4, 2, 64, torch.bfloat16, tile=None)


def test_prefill_only_padding_writes_nothing():
    # a step whose sequences and rows are all padding: every program returns at once
    k_cache, v_cache, _, _ = paged_setup([16], 16, 2, 32, torch.float32)
    query, tables = torch.randn(6, 4, 32), torch.zeros(3, 1, dtype=torch.int32)
    starts, lens = torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    out = torch.full_like(query, 7.0)
    paged_prefill_attention_triton(query, k_cache, v_cache, tables, starts, lens, 0.5, out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("block_q", [1, 5, 16])
def test_prefill_programs_cover_every_query_block_once(block_q):
    """The grid (from shapes only) has a program for every query block of every sequence,
    whatever the lengths: emulate the kernel's binary search and early exit on the host."""
    gen = torch.Generator().manual_seed(block_q)
    num_tokens, num_seqs = 48, 7
    for _ in range(50):
        cuts = torch.randint(0, num_tokens + 1, (num_seqs - 1,), generator=gen).sort().values
        real = int(torch.randint(0, num_tokens + 1, (1,), generator=gen))  # then padding rows
        starts = [0, *[min(int(c), real) for c in cuts], real]
        owners = []
        grid = prefill_grid(num_tokens, num_seqs, 2, block_q)
        assert grid == (num_tokens // block_q + num_seqs, 2)  # shapes only
        for program in range(grid[0]):
            firsts = [starts[b] // block_q + b for b in range(num_seqs)]
            seq = max(b for b in range(num_seqs) if firsts[b] <= program)
            q_block = program - firsts[seq]
            if q_block * block_q < starts[seq + 1] - starts[seq]:
                owners.append((seq, q_block))
        expected = [(b, i) for b in range(num_seqs)
                    for i in range(-(-(starts[b + 1] - starts[b]) // block_q))]  # fmt: skip
        assert owners == expected


def test_prefill_same_shapes_other_lengths():
    """One launch shape (24 rows, 3 sequences, same table width) serves any split of the rows:
    the kernel reads the split from device tensors only."""
    for query_lens, seq_lens in [([20, 1, 3], [20, 30, 3]), ([1, 1, 22], [40, 2, 22]),
                                 ([8, 8, 8], [8, 47, 8])]:  # fmt: skip
        check_prefill(query_lens, seq_lens, 16, 6, 2, 16, torch.float32)
    assert query_block(16, 3) == (16, 5) and query_block(64, 4) == (64, 16)
    assert query_block(16, 20) == (32, 1)
    with pytest.raises(ValueError, match="block_m"):
        query_block(24, 1)


# ---------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(1, 2, 64), (16, 3, 80)])
def test_copy_blocks_matches_reference(block_size, num_kv_heads, head_dim):
    torch.manual_seed(0)
    k_ref = random_cache(8, block_size, num_kv_heads, head_dim, torch.float32)
    v_ref = random_cache(8, block_size, num_kv_heads, head_dim, torch.float32)
    k_tri = random_cache(8, block_size, num_kv_heads, head_dim, torch.float32, strided=True)
    k_tri.copy_(k_ref)
    v_tri = v_ref.clone()
    src = torch.tensor([5, 0, 2], dtype=torch.int64)
    dst = torch.tensor([1, 7, 6], dtype=torch.int64)
    before = k_ref.clone()

    copy_blocks_reference(k_ref, v_ref, src, dst)
    copy_blocks_triton(k_tri, v_tri, src, dst)
    assert torch.equal(k_ref[dst], before[src])  # the reference itself does what it says
    assert torch.equal(k_tri, k_ref)
    assert torch.equal(v_tri, v_ref)


def test_copy_blocks_dispatch_on_cpu():
    k_cache = torch.arange(4.0).view(4, 1, 1, 1).expand(4, 2, 1, 16).contiguous()
    v_cache = k_cache.clone()
    copy_blocks(k_cache, v_cache, torch.tensor([3]), torch.tensor([0]))
    assert (k_cache[0] == 3).all() and (v_cache[0] == 3).all()


# ---------------------------------------------------------------- backend


@pytest.mark.parametrize(("block_size", "hq", "hkv", "head_dim"), [(16, 4, 2, 64), (1, 8, 1, 80)])
def test_triton_backend_matches_torch_backend(block_size, hq, hkv, head_dim):
    # Two decodes first, then a chunk with a cached prefix, then a fresh prompt.
    query_lens = [1, 1, 5, 23]
    seq_lens = [17, 33, 40, 23]
    k_cache, v_cache, _, tables = paged_setup(
        seq_lens, block_size, hkv, head_dim, torch.float32, poison=False
    )
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    assert meta.num_decodes == 2
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, hq, head_dim)
    key = torch.randn(num_tokens, hkv, head_dim)
    value = torch.randn(num_tokens, hkv, head_dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    expected = TorchAttentionBackend().forward(query, key, value, k_ref, v_ref, meta, 0.125)
    out = TritonAttentionBackend().forward(query, key, value, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_backend_check_device(monkeypatch):
    backend = TritonAttentionBackend()
    backend.check_device(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend.check_device(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="torch attention backend|TRITON_INTERPRET=1"):
        backend.check_device(torch.device("cpu"))


# ---------------------------------------------------------------- wide sweep


@pytest.mark.slow
@pytest.mark.parametrize(
    ("block_size", "head_dim", "hq", "hkv"),
    [
        (2, 64, 8, 1),
        (4, 128, 4, 4),
        (8, 80, 4, 4),
        (32, 128, 8, 2),
        (64, 64, 8, 2),
        (256, 80, 8, 1),
    ],
)
def test_sweep_decode_and_prefill(block_size, head_dim, hq, hkv):
    # CI runs slow tests too, so this covers the remaining block sizes in a few cases only.
    check_decode([2, 63, 129], block_size, hq, hkv, head_dim, torch.float32, num_splits=3)
    check_prefill([9, 64, 1], [40, 64, 130], block_size, hq, hkv, head_dim, torch.float32)


def test_split_choices_follow_the_gpu_size(monkeypatch):
    """The split-K heuristics of the decode attention and quantized matmul kernels, with a
    stand-in 132-SM GPU (what they do on CUDA, checked without one)."""
    from paged_llm.ops import tuning
    from paged_llm.ops.paged_attention import triton_decode
    from paged_llm.ops.quant_matmul import triton as quant_triton

    monkeypatch.setattr(tuning, "_cuda_sms", lambda index: 132)
    for module in (triton_decode, quant_triton):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    gpu = torch.device("cuda", 0)
    assert tuning.num_sms(gpu) == 132
    # enough (sequence, KV head) programs: no split; few: split by length, at most 2 x SMs
    assert triton_decode.choose_num_splits(4096, 8192, gpu) == 1
    assert triton_decode.choose_num_splits(32, 8192, gpu) == 9  # ceil(264 / 32)
    assert triton_decode.choose_num_splits(32, 1024, gpu) == 2  # 1024 // 512
    assert triton_decode.choose_num_splits(32, 8192, torch.device("cpu")) == 1
    # quantized matmul: ~4 programs per SM
    assert quant_triton.choose_split_k(1024, 32, gpu) == 1
    assert quant_triton.choose_split_k(256, 64, gpu) == 3  # ceil(528 / 256)
    assert quant_triton.choose_split_k(16, 64, gpu) == 16
    assert quant_triton.choose_split_k(16, 4, gpu) == 4  # no more splits than K tiles
