"""Fused mixture-of-experts kernel (Triton, in the CPU interpreter) against the torch reference
and a naive float64 per-token loop, over odd sizes, skewed routing and strided views; and the
block alignment (``moe_align_block_size``) on its own."""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from paged_llm.ops.moe.reference import fused_experts_reference, select_experts  # noqa: E402
from paged_llm.ops.moe.triton import (  # noqa: E402
    choose_block_m,
    fused_experts_triton,
    moe_align_block_size,
    padded_length,
)

# fp32: the same float32 math up to the order of the sums. fp16: both implementations round the
# gate/up projections and the SwiGLU product to fp16 (so agree to a few fp16 steps); the kernel
# then adds the k experts in float32 and rounds once, where the reference rounds each term.
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}
DTYPES = [torch.float32, torch.float16]
HIDDEN, INTER = 40, 24  # neither a multiple of the 16/32/64 tiles


def _naive(x, gate_up, down, topk_weights, topk_ids):
    """Token by token, slot by slot in float64, independent of both implementations."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(topk_ids[t].tolist()):
            h = gate_up[e].double() @ x[t].double()  # [2I]
            act = F.silu(h[:inter]) * h[inter:]
            out[t] += topk_weights[t, j].double() * (down[e].double() @ act)
    return out.to(x.dtype)


def _weights(experts, hidden, inter, dtype, gen):
    """gate_up [E, 2I, H] and down [E, H, I], scaled so activations stay near unit size."""
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up.to(dtype), down.to(dtype)


def _case(tokens, top_k, experts, dtype, seed, hidden=HIDDEN, inter=INTER):
    """Random inputs routed as a model routes them: softmax top-k of random logits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up, down = _weights(experts, hidden, inter, dtype, gen)
    topk_weights, topk_ids = select_experts(
        torch.randn(tokens, experts, generator=gen), top_k, renormalize=True
    )
    return x, gate_up, down, topk_weights, topk_ids


def _check(x, gate_up, down, topk_weights, topk_ids, **overrides):
    """The kernel against the reference and the naive loop (and those two against each other)."""
    tol = TOL[x.dtype]
    expected = _naive(x, gate_up, down, topk_weights, topk_ids)
    reference = fused_experts_reference(x, gate_up, down, topk_weights, topk_ids)
    out = fused_experts_triton(x, gate_up, down, topk_weights, topk_ids, **overrides)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(out, reference, **tol)
    torch.testing.assert_close(reference, expected, **tol)


CASES = [  # tokens, top_k, experts (k <= E: a token's experts are distinct)
    (t, k, e) for t, k, e in itertools.product([1, 3, 37], [1, 2], [1, 4, 8]) if k <= e
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,experts", CASES)
def test_triton_matches_reference_and_naive_loop(tokens, top_k, experts, dtype):
    _check(*_case(tokens, top_k, experts, dtype, seed=tokens * 100 + top_k * 10 + experts))


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_tiles_loop_over_k_and_n(dtype):
    """Tiles below the sizes: 3 K tiles of GEMM1 and 2 of GEMM2, 3 N tiles of each, masked
    tails everywhere; a 32-row block holds several experts' worth of padding."""
    _check(*_case(37, 2, 8, dtype, seed=5), block_m=32, block_n=16, block_k=16)


def test_expert_without_tokens_and_prefill_sized_block():
    """Expert 1 gets no pair (no block, no weight read); 64-row blocks, the prefill tile."""
    x, gate_up, down, topk_weights, _ = _case(37, 2, 4, torch.float32, seed=6)
    topk_ids = torch.tensor([0, 2, 3])[torch.arange(74).remainder(3)].view(37, 2)
    _check(x, gate_up, down, topk_weights, topk_ids, block_m=64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_tokens_on_one_expert(dtype):
    """37 pairs on expert 2 of 8: three 16-row blocks of one expert, the last one padded."""
    x, gate_up, down, topk_weights, _ = _case(37, 1, 8, dtype, seed=7)
    _check(x, gate_up, down, topk_weights, torch.full((37, 1), 2, dtype=torch.int64))


def test_strided_inputs_int32_ids():
    """x a column slice of a wider tensor, then a transposed view; transposed weights,
    non-contiguous routing weights and int32 ids."""
    x, gate_up, down, topk_weights, topk_ids = _case(5, 2, 4, torch.float32, seed=8)
    wide = torch.randn(5, HIDDEN + 9)
    wide[:, 3 : 3 + HIDDEN] = x
    x_sliced = wide[:, 3 : 3 + HIDDEN]  # [T, H] row stride H + 9
    x_transposed = x.T.contiguous().T  # [T, H] strides (1, T)
    gate_up_t = (
        gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    )  # [E, 2I, H] strides (., 1, 2I)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)  # [E, H, I] strides (., 1, H)
    weights_t = topk_weights.T.contiguous().T  # [T, k] strides (1, T)
    ids32 = topk_ids.to(torch.int32)
    for xs in (x_sliced, x_transposed):
        _check(xs, gate_up_t, down_t, weights_t, ids32)


def test_empty_batch():
    """No tokens: an empty [0, H] result, no launch."""
    _, gate_up, down, _, _ = _case(1, 2, 4, torch.float32, seed=9)
    out = fused_experts_triton(
        torch.empty(0, HIDDEN),
        gate_up,
        down,
        torch.empty(0, 2),
        torch.empty(0, 2, dtype=torch.int64),
    )
    assert out.shape == (0, HIDDEN)


def test_bad_arguments_raise():
    x, gate_up, down, topk_weights, topk_ids = _case(3, 2, 4, torch.float32, seed=10)
    bad = [
        (x[0], gate_up, down, topk_weights, topk_ids),  # x not 2-D
        (x[:, :-1], gate_up, down, topk_weights, topk_ids),  # H disagrees with gate_up
        (x, gate_up[:, :-1], down, topk_weights, topk_ids),  # odd 2I
        (x, gate_up, down[:, :, :-1], topk_weights, topk_ids),  # I disagrees
        (x, gate_up, down[:-1], topk_weights, topk_ids),  # E disagrees
        (x, gate_up, down, topk_weights[:-1], topk_ids[:-1]),  # T disagrees
        (x, gate_up, down, topk_weights[:, :1], topk_ids),  # k disagrees
        (x, gate_up.half(), down, topk_weights, topk_ids),  # weight dtype
        (x.long(), gate_up, down, topk_weights, topk_ids),  # activation dtype
        (x, gate_up, down, topk_weights, topk_ids.float()),  # ids dtype
    ]
    for args in bad:
        with pytest.raises(ValueError):
            fused_experts_triton(*args)
    with pytest.raises(ValueError, match="block_m"):
        fused_experts_triton(x, gate_up, down, topk_weights, topk_ids, block_m=8)
    with pytest.raises(ValueError, match="block_k"):
        fused_experts_triton(x, gate_up, down, topk_weights, topk_ids, block_k=48)


# --- moe_align_block_size ------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize(
    "topk_ids,experts",
    [
        (torch.tensor([[1, 3], [3, 1], [1, 0]]), 4),  # expert 2 empty
        (torch.full((37, 1), 2), 8),  # one expert, several blocks
        (torch.randint(0, 8, (37, 2), generator=torch.Generator().manual_seed(0)), 8),
        (torch.tensor([[5]], dtype=torch.int32), 64),  # decode: E far above the pairs
    ],
)
def test_align_sorts_pairs_into_single_expert_blocks(topk_ids, experts, block_m):
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, block_m, experts)
    length = padded_length(pairs, experts, block_m)
    assert sorted_ids.dtype == block_expert.dtype == num_padded.dtype == torch.int32
    assert sorted_ids.shape == (length,) and block_expert.shape == (length // block_m,)
    assert length % block_m == 0 and length <= pairs + experts * (block_m - 1) + block_m

    counts = torch.bincount(flat, minlength=experts)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert num_padded.tolist() == [used]
    # Every pair exactly once, everything else the sentinel.
    real = sorted_ids[sorted_ids != pairs].long()
    assert sorted(real.tolist()) == list(range(pairs))
    assert (sorted_ids[used:] == pairs).all()
    # Each used block holds one expert's pairs (in pair order), in increasing expert order;
    # blocks past the used length have expert -1.
    blocks = sorted_ids[:used].view(-1, block_m).long()
    experts_of_blocks = block_expert[: used // block_m].long()
    assert (block_expert[used // block_m :] == -1).all()
    assert (experts_of_blocks.diff() >= 0).all()
    for ids, expert in zip(blocks, experts_of_blocks.tolist()):
        mine = ids[ids != pairs]
        assert len(mine) > 0 and (flat[mine] == expert).all()
        assert (mine.diff() > 0).all()
    # Only the last block of each expert is padded, and only at its end.
    for expert in range(experts):
        run = blocks[experts_of_blocks == expert].reshape(-1)
        assert len(run) == (int(counts[expert]) + block_m - 1) // block_m * block_m
        assert (run[: int(counts[expert])] != pairs).all()


def test_align_empty_and_block_m_choice():
    sorted_ids, block_expert, num_padded = moe_align_block_size(
        torch.empty(0, 2, dtype=torch.int64), 16, 4
    )
    assert sorted_ids.numel() == 0 and block_expert.numel() == 0 and num_padded.tolist() == [0]
    assert choose_block_m(1 * 8, 64) == 16  # decode: under one pair per expert
    assert choose_block_m(37 * 2, 8) == 16
    assert choose_block_m(512 * 2, 8) == 64  # prefill: 128 pairs per expert


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_experts_match_the_dequantized_reference(method, dtype, tokens):
    """int8 / fp8 e4m3 expert weights with per-channel scales (quantization="int8" / "fp8"):
    the kernel equals the reference, and the reference equals float weights holding the
    dequantized values."""
    from paged_llm.quant.layers import fp8_per_channel, int8_per_channel

    per_channel = {"int8": int8_per_channel, "fp8": fp8_per_channel}[method]
    x, gate_up, down, weights, ids = _case(tokens, 2, 4, dtype, seed=7)
    q_gate_up, s_gate_up = per_channel(gate_up)
    q_down, s_down = per_channel(down)
    scaled = dict(gate_up_scale=s_gate_up, down_scale=s_down)
    ref = fused_experts_reference(x, q_gate_up, q_down, weights, ids, **scaled)
    out = fused_experts_triton(x, q_gate_up, q_down, weights, ids, **scaled)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    deq_gate_up = (q_gate_up.float() * s_gate_up[..., None]).to(dtype)
    deq_down = (q_down.float() * s_down[..., None]).to(dtype)
    plain = fused_experts_reference(x, deq_gate_up, deq_down, weights, ids)
    torch.testing.assert_close(ref, plain, **TOL[dtype])
    with pytest.raises(ValueError, match="must be int8 or float8_e4m3fn with scales"):
        fused_experts_triton(x, gate_up, q_down, weights, ids, **scaled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_parallel_ranks_sum_to_the_whole_layer(dtype):
    """Expert parallelism over 2 ranks: each rank holds 2 of 4 experts and sees the others'
    pairs as expert -1, which both implementations skip; the ranks' outputs sum to the layer."""
    x, gate_up, down, weights, ids = _case(37, 2, 4, dtype, seed=5)
    whole = _naive(x, gate_up, down, weights, ids).float()
    parts = []
    for first in (0, 2):
        local = torch.where((ids >= first) & (ids < first + 2), ids - first, -1)
        args = (x, gate_up[first : first + 2], down[first : first + 2], weights, local)
        ref, out = fused_experts_reference(*args), fused_experts_triton(*args)
        torch.testing.assert_close(out, ref, **TOL[dtype])
        parts.append(out.float())
    torch.testing.assert_close(parts[0] + parts[1], whole, **TOL[dtype])
    sorted_ids, _, num_padded = moe_align_block_size(torch.full((3, 2), -1), 16, 2)
    assert int(num_padded) == 0 and (sorted_ids == 6).all()  # nothing routed here


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("group", [16, 32])
def test_int4_experts_match_the_dequantized_reference(group, dtype, tokens):
    """int4 expert weights (quantization="int4_rtn"): two codes per byte along K, a scale and a
    zero per output channel and group. The kernel equals the reference, and the reference
    equals float weights holding the dequantized values."""
    from paged_llm.layers.moe import FusedExperts
    from paged_llm.ops.moe.reference import expert_weight, unpack_int4_experts
    from paged_llm.quant.experts import quantize_experts_int4

    hidden, inter, experts = 64, 32, 4
    x, gate_up, down, weights, ids = _case(tokens, 2, experts, dtype, 11, hidden, inter)
    module = FusedExperts(experts, hidden, inter)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up.float())
        module.down_proj.copy_(down.float())
    quantize_experts_int4(module, group)
    q = dict(gate_up_scale=module.gate_up_scale, down_scale=module.down_scale,
             gate_up_zero=module.gate_up_zero, down_zero=module.down_zero)  # fmt: skip
    assert module.down_proj.shape == (experts, hidden, inter // 2)
    assert module.down_proj.dtype == torch.uint8 and q["down_scale"].shape == (4, 64, 32 // group)
    codes = unpack_int4_experts(module.gate_up_proj)
    assert int(codes.max()) <= 15 and codes.shape == gate_up.shape
    ref = fused_experts_reference(x, module.gate_up_proj, module.down_proj, weights, ids, **q)
    out = fused_experts_triton(x, module.gate_up_proj, module.down_proj, weights, ids, **q)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    plain = [torch.stack([expert_weight(w, s, e, dtype, z) for e in range(experts)])
             for w, s, z in ((module.gate_up_proj, q["gate_up_scale"], q["gate_up_zero"]),
                             (module.down_proj, q["down_scale"], q["down_zero"]))]  # fmt: skip
    torch.testing.assert_close(ref, fused_experts_reference(x, *plain, weights, ids), **TOL[dtype])
    # round to nearest: within half a step of the float weights
    step = q["gate_up_scale"].repeat_interleave(group, dim=2)
    assert ((plain[0].float() - gate_up.float()).abs() <= 0.51 * step + 1e-6).all()


def test_int4_experts_with_a_group_the_kernel_cannot_tile_are_refused():
    from paged_llm.ops.moe.reference import pack_int4_experts

    x, gate_up, down, weights, ids = _case(3, 2, 4, torch.float32, 0, 64, 32)
    gate_up_q = pack_int4_experts(torch.zeros(4, 64, 64, dtype=torch.uint8))
    down_q = pack_int4_experts(torch.zeros(4, 64, 32, dtype=torch.uint8))
    # groups of 8 inputs: too small for a K tile of 16
    ones = {
        name: torch.ones(4, rows, groups)
        for name, rows, groups in (("gate_up", 64, 8), ("down", 64, 4))
    }
    q = dict(gate_up_scale=ones["gate_up"], down_scale=ones["down"],
             gate_up_zero=ones["gate_up"].to(torch.uint8),
             down_zero=ones["down"].to(torch.uint8))  # fmt: skip
    with pytest.raises(ValueError, match="power of two >= 16"):
        fused_experts_triton(x, gate_up_q, down_q, weights, ids, **q)
