"""Batched multi-LoRA kernels (Triton, in the CPU interpreter) against the torch reference and a
naive per-token loop, over odd sizes, padded ranks, mixed / absent adapters and strided views."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from paged_llm.ops.lora import add_lora  # noqa: E402
from paged_llm.ops.lora.reference import add_lora_reference  # noqa: E402
from paged_llm.ops.lora.triton import add_lora_triton  # noqa: E402

# fp32: the same float32 math up to the order of the sums; fp16: every path adds in float32 and
# rounds once, so results are at most one fp16 rounding step apart.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = [torch.float32, torch.float16]


def _naive(y, x, lora_a, lora_b, token_slots):
    """Token by token in float64, independent of both implementations under test."""
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            delta = (x[t].double() @ lora_a[slot].double().T) @ lora_b[slot].double().T
            out[t] = (y[t].double() + delta).to(y.dtype)
    return out


def _case(tokens, k, n, rank, slots, pattern, dtype, seed):
    """Random inputs: x and y as row-strided views of wider tensors, ranks padded with zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k + 7, generator=gen).to(dtype)[:, 3 : 3 + k]  # [T, K] strided
    y_wide = torch.randn(tokens, n + 5, generator=gen).to(dtype)
    lora_a = torch.randn(slots, rank, k, generator=gen) / k**0.5  # [S, R, K]
    lora_b = torch.randn(slots, n, rank, generator=gen) / rank**0.5  # [S, N, R]
    for s in range(slots):
        # Adapters of smaller ranks share the padded R: zero rows of A, zero columns of B.
        true_rank = max(1, rank - 5 * s)
        lora_a[s, true_rank:] = 0
        lora_b[s, :, true_rank:] = 0
    if pattern == "none":
        token_slots = torch.full((tokens,), -1, dtype=torch.int64)
    elif pattern == "single":
        token_slots = torch.full((tokens,), slots - 1, dtype=torch.int64)
    else:  # mixed: random slots, the first token always without an adapter
        token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
        token_slots[0] = -1
    return y_wide, x, lora_a.to(dtype), lora_b.to(dtype), token_slots


def _check(y_wide, x, lora_a, lora_b, token_slots, dtype, **blocks):
    """Run the kernels on y (a view of y_wide) and compare with the reference and naive loop."""
    n = lora_b.shape[1]
    before = y_wide.clone()
    y = y_wide[:, 2 : 2 + n]  # [T, N] row-strided view
    expected = _naive(y, x, lora_a, lora_b, token_slots)
    reference = add_lora_reference(y.clone(), x, lora_a, lora_b, token_slots)
    out = add_lora_triton(y, x, lora_a, lora_b, token_slots, **blocks)
    assert out is y and out.dtype == dtype
    torch.testing.assert_close(out, reference, **TOL[dtype])
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(reference, expected, **TOL[dtype])
    skipped = token_slots < 0
    assert torch.equal(out[skipped], before[:, 2 : 2 + n][skipped])  # bit-identical
    assert torch.equal(reference[skipped], before[:, 2 : 2 + n][skipped])
    # Columns outside the view are never written.
    assert torch.equal(y_wide[:, :2], before[:, :2])
    assert torch.equal(y_wide[:, 2 + n :], before[:, 2 + n :])


CASES = [  # tokens, K, N, R, S, slot pattern
    (1, 48, 96, 1, 1, "single"),
    (1, 200, 48, 8, 3, "none"),
    (5, 96, 200, 16, 3, "mixed"),
    (5, 200, 96, 24, 1, "mixed"),
    (5, 48, 48, 1, 3, "mixed"),
    (33, 48, 200, 8, 3, "mixed"),
    (33, 96, 48, 24, 3, "single"),
    (33, 200, 96, 16, 1, "none"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n,rank,slots,pattern", CASES)
def test_triton_matches_reference_and_naive_loop(tokens, k, n, rank, slots, pattern, dtype):
    seed = tokens * 1000 + k + n + rank + slots
    _check(*_case(tokens, k, n, rank, slots, pattern, dtype, seed), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_tiles_loop_over_k_n_and_r(dtype):
    """Tiles far below the sizes: several K tiles, N tiles and R tiles, each with a masked tail."""
    y_wide, x, lora_a, lora_b, token_slots = _case(5, 200, 96, 24, 3, "mixed", dtype, seed=7)
    _check(y_wide, x, lora_a, lora_b, token_slots, dtype, block_k=32, block_n=16, block_r=8)


def test_int32_slots_and_arbitrary_strides():
    """Column-strided x and y (transposed views), non-contiguous weights and int32 slots."""
    gen = torch.Generator().manual_seed(3)
    tokens, k, n, rank, slots = 5, 48, 96, 8, 3
    x = torch.randn(k, tokens, generator=gen).T  # [T, K] strides (1, T)
    y = torch.randn(n, tokens, generator=gen).T  # [T, N] strides (1, T)
    lora_a = torch.randn(slots, k, rank, generator=gen).transpose(1, 2) / k**0.5  # [S, R, K]
    lora_b = torch.randn(slots, rank, n, generator=gen).transpose(1, 2) / rank**0.5  # [S, N, R]
    token_slots = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32)
    expected = _naive(y, x, lora_a, lora_b, token_slots)
    reference = add_lora_reference(y.clone(), x, lora_a, lora_b, token_slots)
    out = add_lora_triton(y, x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    torch.testing.assert_close(reference, expected, **TOL[torch.float32])


def test_output_may_alias_input():
    """y is x (N == K): every token's update is computed from x before any row is written."""
    y_wide, x, lora_a, _, token_slots = _case(5, 48, 48, 8, 3, "mixed", torch.float32, seed=5)
    lora_b = torch.randn(3, 48, 8) / 8**0.5
    expected = _naive(x, x, lora_a, lora_b, token_slots)
    reference = add_lora_reference(x.clone(), x.clone(), lora_a, lora_b, token_slots)
    out = add_lora_triton(x, x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    torch.testing.assert_close(reference, expected, **TOL[torch.float32])


def test_empty_batch_and_cpu_dispatch():
    """No tokens is a no-op; on the CPU ``add_lora`` is the reference, in place."""
    lora_a, lora_b = torch.randn(2, 4, 48), torch.randn(2, 96, 4)
    empty = torch.empty(0, 96)
    slots = torch.empty(0, dtype=torch.int64)
    assert add_lora_triton(empty, torch.empty(0, 48), lora_a, lora_b, slots) is empty
    assert add_lora_reference(empty, torch.empty(0, 48), lora_a, lora_b, slots) is empty

    y_wide, x, lora_a, lora_b, token_slots = _case(5, 48, 96, 4, 2, "mixed", torch.float32, 11)
    y = y_wide[:, :96]
    expected = add_lora_reference(y.clone(), x, lora_a, lora_b, token_slots)
    assert add_lora(y, x, lora_a, lora_b, token_slots) is y
    assert torch.equal(y, expected)


def test_bad_arguments_are_refused():
    y, x = torch.zeros(4, 96), torch.zeros(4, 48)
    a, b = torch.zeros(3, 8, 48), torch.zeros(3, 96, 8)
    slots = torch.zeros(4, dtype=torch.int64)
    bad = [
        ("y must be", (torch.zeros(4, 96, 1), x, a, b, slots)),
        ("y must be", (torch.zeros(4, 96, dtype=torch.int32), x, a, b, slots)),
        ("x must be", (y, torch.zeros(5, 48), a, b, slots)),
        ("lora_a must be", (y, x, torch.zeros(3, 8, 47), b, slots)),
        ("lora_a must be", (y, x, torch.zeros(8, 48), b, slots)),
        ("lora_b must be", (y, x, a, torch.zeros(3, 8, 96), slots)),  # [S, R, N]: transposed
        ("lora_b must be", (y, x, a, torch.zeros(2, 96, 8), slots)),
        ("token_slots must be", (y, x, a, b, torch.zeros(4))),
        ("token_slots must be", (y, x, a, b, torch.zeros(3, dtype=torch.int64))),
        ("all tensors must be on one device", (y.to("meta"), x, a, b, slots)),
    ]
    for message, args in bad:
        for op in (add_lora_triton, add_lora_reference):
            with pytest.raises(ValueError, match=f"add_lora: {message}"):
                op(*args)
    with pytest.raises(ValueError, match="add_lora: block_n"):
        add_lora_triton(y, x, a, b, slots, block_n=24)
