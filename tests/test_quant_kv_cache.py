"""Quantized KV cache (kv_cache_dtype=int8 / fp8_e4m3): the store op quantizes, attention
dequantizes, scales travel with their blocks, and the same memory holds about twice the
tokens of a 16-bit cache. The Triton kernels are checked against the torch reference in the
CPU interpreter (TRITON_INTERPRET=1, set before Triton is imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from paged_llm import LLM, SamplingParams  # noqa: E402
from paged_llm.attention.metadata import build_attention_metadata  # noqa: E402
from paged_llm.attention.torch_backend import (
    TorchAttentionBackend,  # noqa: E402
    store_kv_reference,  # noqa: E402
)
from paged_llm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from paged_llm.layers.attention import ForwardContext  # noqa: E402
from paged_llm.models import trained  # noqa: E402
from paged_llm.models.loader import kv_cache_shape_info, load_model  # noqa: E402
from paged_llm.ops.kv_store.triton import store_kv_triton  # noqa: E402
from paged_llm.ops.paged_attention.reference import (  # noqa: E402
    gather_kv,
    paged_attention_reference,
    paged_decode_attention_batched,
)
from paged_llm.quant.kv_cache import SCALE_DTYPE, kv_cache_spec  # noqa: E402
from paged_llm.runner.kv_cache import (  # noqa: E402
    allocate_kv_caches,
    allocate_kv_scales,
    kv_bytes_per_block,
)

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(5)]
# Worst-case error of one element relative to its vector's absmax: half an int8 step, or
# half an e4m3 ulp at the top of the range (3 mantissa bits).
TOLERANCE = {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3": 2.0**-4}


def _pools(name, num_blocks=8, block_size=4, heads=2, dim=16):
    spec = kv_cache_spec(name, torch.float32)
    ((k, v),) = allocate_kv_caches(1, num_blocks, block_size, heads, dim, spec.dtype, "cpu")
    ((ks, vs),) = allocate_kv_scales(1, num_blocks, block_size, heads, SCALE_DTYPE, "cpu")
    return k, v, ks, vs


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_store_then_gather_round_trips_within_one_step(name):
    k_cache, v_cache, k_scale, v_scale = _pools(name)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(10, 2, 16, generator=gen) * torch.logspace(-2, 2, 10)[:, None, None]
    value = torch.randn(10, 2, 16, generator=gen)
    table = torch.tensor([6, 1, 3], dtype=torch.int32)  # non-contiguous blocks
    slots = torch.tensor([int(table[p // 4]) * 4 + p % 4 for p in range(10)])
    store_kv_reference(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    assert k_cache.dtype == kv_cache_spec(name, torch.float32).dtype
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        back = gather_kv(cache, table, 10, scale)
        err = (back - x).abs().amax(-1) / x.abs().amax(-1)  # per vector, relative to absmax
        assert err.max() <= TOLERANCE[name]


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_quantized_attention_paths_agree(name):
    k_cache, v_cache, k_scale, v_scale = _pools(name, num_blocks=12)
    gen = torch.Generator().manual_seed(1)
    seq_lens, tables = [7, 12, 3], [[4, 0], [2, 9, 5], [11]]
    meta = build_attention_metadata([1, 1, 1], seq_lens, tables, 4)
    for s_len, table in zip(seq_lens, tables):  # fill every context
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(s_len)])
        kv = torch.randn(2, s_len, 2, 16, generator=gen)
        store_kv_reference(kv[0], kv[1], k_cache, v_cache, slots, k_scale, v_scale)
    query = torch.randn(3, 4, 16, generator=gen)  # GQA: 4 query heads on 2 KV heads
    scales = (k_scale, v_scale)
    batched = paged_decode_attention_batched(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25, *scales
    )
    looped = paged_attention_reference(
        query, k_cache, v_cache, meta.block_tables, [1, 1, 1], seq_lens, 0.25, *scales
    )
    assert torch.allclose(batched, looped, atol=1e-5)


def test_quantized_cache_holds_about_twice_the_tokens():
    fp16 = kv_bytes_per_block(32, 32, 128, 16, torch.float16)  # a LLaMA-7B block
    int8 = kv_bytes_per_block(32, 32, 128, 16, torch.int8, SCALE_DTYPE)
    assert int8 / fp16 == pytest.approx((128 + 4) / (2 * 128))


def _ids(llm, n=12):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_engine_with_quantized_cache(tiny_llama, name):
    path = str(tiny_llama[0])
    ref = _ids(LLM(path, cpu_kv_cache_gib=0.01))
    llm = LLM(path, cpu_kv_cache_gib=0.01, kv_cache_dtype=name)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == kv_cache_spec(name, None).dtype
    # fp32 model (64 B per element pair ...) vs 1 byte + a 4-byte scale per 16-dim vector
    head_dim = 16
    ratio = llm.llm_engine.num_kv_blocks / LLM(path, cpu_kv_cache_gib=0.01).llm_engine.num_kv_blocks
    assert ratio == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)
    out = _ids(llm)
    assert llm.llm_engine.backend.name == "cpu"  # decodes read the codes in the native kernel
    torch_path = LLM(path, cpu_kv_cache_gib=0.01, kv_cache_dtype=name, attention_backend="torch")
    assert _ids(torch_path) == out  # ... as the torch backend's dequantize-then-attend
    # Random weights: once a near-tie flips, the rest of that sequence differs (the logits
    # themselves are checked teacher-forced below), so only the first tokens must all agree.
    assert [o[0] for o in out] == [r[0] for r in ref]
    agree = sum(a == b for r, o in zip(ref, out) for a, b in zip(r, o)) / sum(map(len, ref))
    assert agree >= 0.5
    # Preemption by swapping moves codes and scales together: outputs do not change.
    swapped = LLM(
        path, kv_cache_dtype=name, block_size=4, num_gpu_blocks_override=20, max_model_len=64,
        preemption_mode="swap", swap_space=0.01,
    )  # fmt: skip
    assert _ids(swapped) == out
    assert swapped.llm_engine.scheduler.num_preemptions_total > 0
    contiguous = LLM(
        path, kv_cache_dtype=name, attention_backend="contiguous", policy="static",
        cpu_kv_cache_gib=0.01, max_model_len=64,
    )  # fmt: skip
    assert _ids(contiguous) == out


@pytest.mark.parametrize("name,max_rel", [("int8", 0.01), ("fp8_e4m3", 0.05)])
def test_teacher_forced_logits_with_quantized_cache(name, max_rel):
    d = trained.trained_model_dir("test-target")
    model, cfg = load_model(d, torch.float32)
    layers, heads, dim = kv_cache_shape_info(cfg)
    ids = torch.from_numpy(trained.corpus_tokens("test-target")[:64].astype("int64"))
    meta = build_attention_metadata([64], [64], [[3, 0, 2, 1]], 16)

    def logits(kv_dtype):
        spec = kv_cache_spec(kv_dtype, torch.float32)
        caches = allocate_kv_caches(layers, 4, 16, heads, dim, spec.dtype, "cpu")
        scales = None
        if spec.quantized:
            scales = allocate_kv_scales(layers, 4, 16, heads, SCALE_DTYPE, "cpu")
        ctx = ForwardContext(meta, TorchAttentionBackend(), caches, scales)
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(64), ctx))

    ref, out = logits("auto"), logits(name)
    assert (out - ref).abs().max() <= max_rel * ref.abs().max()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


class _FloatOnlyBackend(TorchAttentionBackend):
    name = "float-only"
    supports_quantized_kv = False


def test_bad_kv_cache_dtype(tiny_llama):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'.*fp8_e4m3"):
        LLM(str(tiny_llama[0]), kv_cache_dtype="int4", cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="'float-only' cannot read a quantized KV cache"):
        LLM(
            str(tiny_llama[0]), kv_cache_dtype="int8", attention_backend=_FloatOnlyBackend(),
            cpu_kv_cache_gib=0.01,
        )  # fmt: skip


# ---------------------------------------------------------------- Triton kernels


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_store_writes_the_same_codes_and_scales(name, dtype):
    ref, tri = _pools(name, heads=3, dim=24), _pools(name, heads=3, dim=24)  # not powers of 2
    gen = torch.Generator().manual_seed(2)
    key = (torch.randn(9, 3, 24, generator=gen) * 5).to(dtype)
    value = torch.randn(9, 3, 24, generator=gen).to(dtype)
    value[4] = 0  # an all-zero vector keeps a finite scale and zero codes
    slots = torch.tensor([5, 0, 31, 12, -1, 7, 8, 30, 2])  # -1: padding, skipped
    store_kv_reference(key, value, *ref[:2], slots, *ref[2:])
    store_kv_triton(key, value, *tri[:2], slots, *tri[2:])
    for a, b in zip(ref, tri):  # codes bit for bit (same rounding), then scales
        assert torch.equal(a.float(), b.float())


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_triton_backend_reads_the_quantized_cache(name):
    block_size, hq, hkv, dim = 4, 4, 2, 32
    query_lens, seq_lens = [1, 1, 6, 9], [13, 6, 11, 9]  # decodes, a chunk, a fresh prompt
    tables = [[7, 1, 12, 3], [0, 9], [4, 10, 6], [2, 11, 5]]
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    gen = torch.Generator().manual_seed(3)
    pools = _pools(name, num_blocks=13, block_size=block_size, heads=hkv, dim=dim)
    prefix_slots = [
        t[p // block_size] * block_size + p % block_size
        for t, q, s in zip(tables, query_lens, seq_lens)
        for p in range(s - q)
    ]
    kv = torch.randn(2, len(prefix_slots), hkv, dim, generator=gen)
    store_kv_reference(kv[0], kv[1], *pools[:2], torch.tensor(prefix_slots), *pools[2:])
    ref_pools = [t.clone() for t in pools]
    t = sum(query_lens)
    query = torch.randn(t, hq, dim, generator=gen)
    key, value = torch.randn(2, t, hkv, dim, generator=gen)
    k_cache, v_cache, k_scale, v_scale = pools
    expected = TorchAttentionBackend().forward(
        query, key, value, ref_pools[0], ref_pools[1], meta, 0.2, *ref_pools[2:]
    )
    out = TritonAttentionBackend().forward(
        query, key, value, k_cache, v_cache, meta, 0.2, k_scale=k_scale, v_scale=v_scale
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    for a, b in zip(ref_pools, pools):
        assert torch.equal(a.float(), b.float())
