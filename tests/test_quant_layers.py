"""Quantized linear layers, 4-bit packing and the dequantize-and-multiply kernels.

Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set before Triton is imported)
and are compared with the torch reference; fp32 and fp16 only (the interpreter's bf16 tl.dot is
broken)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch import nn  # noqa: E402

from paged_llm.ops.quant_matmul.reference import (  # noqa: E402
    int4_matmul_reference,
    int8_matmul_reference,
)
from paged_llm.ops.quant_matmul.triton import (  # noqa: E402
    _int4_minus_zero,
    fp8_matmul_triton,
    int4_matmul_triton,
    int8_matmul_triton,
)
from paged_llm.quant import build_method  # noqa: E402
from paged_llm.quant.int4 import fake_quantize, rtn_quantize  # noqa: E402
from paged_llm.quant.layers import Fp8Linear, Int4Linear, Int8Linear  # noqa: E402
from paged_llm.quant.packing import (  # noqa: E402
    AWQ_ORDER,
    dequantize_awq_reference,
    dequantize_gptq_reference,
    pack_int4,
    unpack_int4,
)
from paged_llm.quant.simple import Fp8Weights  # noqa: E402


def _linear(k=128, n=64, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    return lin


@pytest.mark.parametrize("order", [tuple(range(8)), AWQ_ORDER])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_unpack_round_trip(dim, order):
    q = torch.randint(0, 16, (32, 24), generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q, dim, order)
    assert packed.dtype == torch.int32 and packed.shape[dim] == q.shape[dim] // 8
    assert torch.equal(unpack_int4(packed, dim, order), q.to(torch.int32))


def test_nibble_positions_follow_the_checkpoint_layouts():
    q = torch.zeros(8, 8, dtype=torch.int64)
    q[3, 0] = 5  # GPTQ qweight: input row 3 of the first eight -> bits 12..15
    assert pack_int4(q, dim=0)[0, 0].item() == 5 << 12
    q = torch.zeros(1, 8, dtype=torch.int64)
    q[0, 1] = 7  # AWQ: column 1 sits in nibble 4 (order 0 2 4 6 1 3 5 7)
    assert pack_int4(q, dim=1, order=AWQ_ORDER)[0, 0].item() == 7 << 16
    q[0, 7] = 15  # nibble 7 sets the sign bit: stored as a negative int32
    assert pack_int4(q, dim=1)[0, 0].item() < 0


def test_int4_layer_matches_plain_gptq_dequantization():
    lin = _linear(64, 16)
    q, scales, zeros = rtn_quantize(lin.weight.detach(), 32)
    layer = Int4Linear.from_quantized(q, scales, zeros, 32, lin.bias)
    plain = dequantize_gptq_reference(layer.qweight, layer.qzeros, layer.scales, layer.g_idx)
    assert torch.equal(layer.dequantize(), plain)
    assert torch.allclose(layer.dequantize(), fake_quantize(lin.weight.detach(), 32))
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), x @ plain.t() + lin.bias, atol=1e-5)
    # error of round-to-nearest: at most half a step (+ the fp16 rounding of the scale)
    step = scales.t().repeat_interleave(32, dim=1)
    assert ((plain - lin.weight).abs() <= 0.5 * step + 1e-4).all()


def test_awq_reference_reads_the_interleaved_layout():
    q = torch.randint(0, 16, (64, 16), generator=torch.Generator().manual_seed(2))  # [K, N]
    z = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(3))
    s = torch.rand(2, 16).half()
    w = dequantize_awq_reference(pack_int4(q, 1, AWQ_ORDER), pack_int4(z, 1, AWQ_ORDER), s, 32)
    expected = ((q - z.repeat_interleave(32, 0)).float() * s.float().repeat_interleave(32, 0)).t()
    assert torch.equal(w, expected)


@pytest.mark.parametrize("cls", [Int8Linear, Fp8Linear])
def test_per_channel_layers(cls):
    lin = _linear()
    layer = cls.from_float(lin)
    w = layer.dequantize()
    rel = (w - lin.weight).abs().amax(1) / lin.weight.abs().amax(1)
    assert rel.max() < (0.5 / 127 + 1e-6 if cls is Int8Linear else 0.07)
    x = torch.randn(2, 5, 128)
    assert torch.allclose(layer(x), x @ w.t() + lin.bias, atol=1e-4)
    assert layer.weight.element_size() == 1


def test_weight_bytes():
    lin = _linear(256, 64, bias=False)
    fp16 = 2 * 256 * 64
    assert Int8Linear.from_float(lin).weight_bytes() == 256 * 64 + 4 * 64
    q, s, z = rtn_quantize(lin.weight.detach(), 128)
    int4 = Int4Linear.from_quantized(q, s, z, 128).weight_bytes()
    assert int4 == 256 * 64 // 2 + 2 * 64 // 2 + 2 * 2 * 64  # codes + zeros + fp16 scales
    assert int4 <= 0.3 * fp16


def test_group_size_must_divide_the_layer():
    model = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(96, 64))]))
    with pytest.raises(ValueError, match=r"layer '0.0.0'.*group_size 64 does not divide .* 96"):
        build_method({"_target_": "paged_llm.quant.simple.Int4RTN", "group_size": 64}).quantize(
            model
        )


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown quantization method 'int3'.*int4_gptq"):
        build_method("int3")


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="FP8 support.*8.0"):
        Fp8Weights().check_device(torch.device("cuda", 0))
    Fp8Weights().check_device(torch.device("cpu"))  # the CPU emulates


# ---------------------------------------------------------------- Triton kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 70])  # 70: two row tiles of 64
def test_int8_kernel_matches_reference(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randint(-127, 128, (80, 72), generator=gen, dtype=torch.int8)  # N, K not tiles
    scale = torch.rand(80, generator=gen) / 100
    x = torch.randn(rows, 72, generator=gen).to(dtype)
    ref = int8_matmul_reference(x.float(), w, scale)
    out = int8_matmul_triton(x, w, scale)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(out.float(), ref, atol=tol * ref.abs().max(), rtol=tol)


@pytest.mark.parametrize(
    "group_size,dtype", [(32, torch.float32), (64, torch.float16), (128, torch.float32)]
)
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_int4_kernel_matches_reference(group_size, dtype, rows):
    gen = torch.Generator().manual_seed(group_size + rows)
    k, n = 256, 48
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) / 50).half()
    qweight, qzeros = pack_int4(q, 0), pack_int4(zeros, 1)
    g_idx = torch.arange(k) // group_size
    x = torch.randn(rows, k, generator=gen).to(dtype)
    for zero_offset in (0, 1):
        ref = int4_matmul_reference(x.float(), qweight, qzeros, scales, g_idx, zero_offset)
        out = int4_matmul_triton(x, qweight, qzeros, scales, group_size, zero_offset)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert torch.allclose(out.float(), ref, atol=tol * ref.abs().max(), rtol=tol)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_path_matches_dot_path_and_reference(rows):
    """Few rows reduce by multiply-and-sum (gemv_rows >= rows) instead of tl.dot (gemv_rows 0):
    both compute the reference's product, int8 and int4, with split-K too."""
    gen = torch.Generator().manual_seed(100 + rows)
    w = torch.randint(-127, 128, (80, 256), generator=gen, dtype=torch.int8)
    scale = torch.rand(80, generator=gen) / 100
    q = torch.randint(0, 16, (256, 80), generator=gen)
    zeros = torch.randint(0, 16, (2, 80), generator=gen)
    scales = (torch.rand(2, 80, generator=gen) / 50).half()
    qweight, qzeros = pack_int4(q, 0), pack_int4(zeros, 1)
    x = torch.randn(rows, 256, generator=gen)
    ref8 = int8_matmul_reference(x, w, scale)
    ref4 = int4_matmul_reference(x, qweight, qzeros, scales, torch.arange(256) // 128, 1)
    for gemv_rows, split_k in ((0, 1), (8, 1), (8, 3)):
        out8 = int8_matmul_triton(x, w, scale, gemv_rows=gemv_rows, split_k=split_k)
        out4 = int4_matmul_triton(x, qweight, qzeros, scales, 128, 1, gemv_rows=gemv_rows,
                                  split_k=split_k)  # fmt: skip
        assert torch.allclose(out8, ref8, atol=1e-5 * ref8.abs().max(), rtol=1e-5)
        assert torch.allclose(out4, ref4, atol=1e-5 * ref4.abs().max(), rtol=1e-5)


@triton.jit
def _minus_zero_kernel(q_ptr, z_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    q, z = tl.load(q_ptr + offs), tl.load(z_ptr + offs)
    tl.store(out_ptr + offs, _int4_minus_zero(q, z, out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int4_minus_zero_is_exact_without_conversion(dtype):
    """The dot path's q - z by exponent bits. bf16: the interpreter does bf16 arithmetic on raw
    bit patterns, so only its exponent trick is checked, in torch."""
    q = torch.arange(16, dtype=torch.int32).repeat_interleave(17)  # every (q, z) pair
    z = torch.arange(17, dtype=torch.int32).repeat(16)  # zeros 0..15, plus GPTQ's offset 1
    q, z = torch.cat([q, q[:240]]), torch.cat([z, z[:240]])  # 512 elements: a power of two
    out = torch.empty(q.numel(), dtype=dtype)
    _minus_zero_kernel[(1,)](q, z, out, N=q.numel())
    assert torch.equal(out, (q - z).to(dtype))
    nibbles = torch.arange(16, dtype=torch.int32)
    bf16 = (nibbles | 0x4300).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(bf16, (nibbles + 128).to(torch.bfloat16))  # the bits read as 128 + q


def test_gemv_k_tile_shrinks_with_rows():
    """The GEMV K tile keeps [rows, K tile, N tile] within the register budget."""
    from paged_llm.ops.quant_matmul.triton import GEMV_ELEMENTS_PER_THREAD, _gemv_block_k

    assert _gemv_block_k(128, 1, 16, 4) == 128
    # int4 tiles hold packed int32s, several K rows per element: a longer K tile fits
    assert _gemv_block_k(256, 4, 64, 4, k_pack=4) == 4 * _gemv_block_k(256, 4, 64, 4) == 128
    for block_m in (1, 2, 4, 8):
        tile = _gemv_block_k(256, block_m, 64, 4)
        assert tile & (tile - 1) == 0 and tile >= 16
        assert block_m * tile * 64 <= GEMV_ELEMENTS_PER_THREAD * 128 or tile == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 6])
def test_fp8_weight_only_kernel_matches_reference(rows, dtype):
    """The 8-bit kernel with e4m3 weights (Fp8Linear's decode path on FP8 GPUs)."""
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(80, 72, generator=gen) * 8).to(torch.float8_e4m3fn)
    scale = torch.rand(80, generator=gen) / 100
    x = torch.randn(rows, 72, generator=gen).to(dtype)
    ref = int8_matmul_reference(x.float(), w.float(), scale)
    out = fp8_matmul_triton(x, w, scale)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(out.float(), ref, atol=tol * ref.abs().max(), rtol=tol)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul_triton(x, w.to(torch.int8), scale)


def test_kernels_refuse_prefill_shapes():
    with pytest.raises(ValueError, match="M <= 256"):
        int8_matmul_triton(
            torch.randn(257, 16), torch.zeros(16, 16, dtype=torch.int8), torch.ones(16)
        )


@pytest.mark.parametrize(
    "block_n,block_k,split_k", [(16, 128, 1), (32, 64, 3), (128, 32, 8), (64, 64, 2)]
)
def test_kernel_launch_overrides_keep_results(block_n, block_k, split_k):
    """The configs that gpu_check sweeps (split-K included: 3 leaves uneven partitions)
    compute the same function as the defaults."""
    gen = torch.Generator().manual_seed(block_n)
    w = torch.randint(-127, 128, (96, 256), generator=gen, dtype=torch.int8)
    scale = torch.rand(96, generator=gen) / 100
    x = torch.randn(3, 256, generator=gen)
    ref = int8_matmul_reference(x, w, scale)
    out = int8_matmul_triton(
        x, w, scale, block_n=block_n, block_k=block_k, num_warps=8, split_k=split_k
    )
    assert torch.allclose(out, ref, atol=1e-5 * ref.abs().max(), rtol=1e-5)
    q = torch.randint(0, 16, (256, 96), generator=gen)
    zeros = torch.randint(0, 16, (2, 96), generator=gen)
    scales = (torch.rand(2, 96, generator=gen) / 50).half()
    qweight, qzeros = pack_int4(q, 0), pack_int4(zeros, 1)
    ref = int4_matmul_reference(x, qweight, qzeros, scales, torch.arange(256) // 128, 1)
    out = int4_matmul_triton(
        x, qweight, qzeros, scales, 128, 1, block_n=block_n, block_k=block_k, split_k=split_k
    )
    assert torch.allclose(out, ref, atol=1e-5 * ref.abs().max(), rtol=1e-5)
