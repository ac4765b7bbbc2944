"""Fused RMSNorm, rotary and SwiGLU kernels (Triton, in the CPU interpreter) against the torch
reference that rounds as transformers does, over odd sizes, strided views and fp32/fp16."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from paged_llm.ops.elementwise.reference import (  # noqa: E402
    rms_norm_reference,
    rotary_reference,
    silu_mul_reference,
)
from paged_llm.ops.elementwise.triton import (  # noqa: E402
    rms_norm_triton,
    rotary_triton,
    silu_mul_triton,
)

# fp32: the same float32 math up to the order of a sum; fp16: at most one rounding step apart;
# bf16: two ulps, because Triton's interpreter truncates float32 -> bfloat16 where GPUs (and
# torch) round to nearest even (seen with Triton 3.9: every converted value matched truncation).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),  # two truncations: up to two ulps
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 200)])
def test_rms_norm_matches_reference(rows, hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 4, 64), (5, 3, 80), (9, 8, 16)])
def test_rotary_matches_reference_on_projection_views(tokens, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    # q heads as a view into a wider projection output: a token stride larger than NH * D
    wide = torch.randn(tokens, heads * head_dim + 24, generator=gen).to(dtype)
    x = wide[:, : heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = rotary_triton(x, cos, sin)
    torch.testing.assert_close(out, rotary_reference(x, cos, sin), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 128), (6, 1000), (2, 2100)])
def test_silu_mul_matches_reference(rows, cols, dtype):
    gen = torch.Generator().manual_seed(cols)
    gate, up = (4 * torch.randn(rows, cols, generator=gen)).to(dtype), torch.randn(rows, cols)
    up = up.to(dtype)
    out = silu_mul_triton(gate, up, block=256)
    torch.testing.assert_close(out, silu_mul_reference(gate, up), **TOL[dtype])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm_triton(torch.randn(2, 3, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="rotary"):
        rotary_triton(torch.randn(2, 3, 5), torch.ones(2, 5), torch.ones(2, 5))
    with pytest.raises(ValueError, match="silu_mul"):
        silu_mul_triton(torch.randn(2, 4), torch.randn(2, 5))


def test_the_op_is_chosen_by_device():
    """CPU tensors never reach a kernel; CUDA ones do unless PAGED_LLM_FUSED_ELEMENTWISE=0."""
    from paged_llm.ops import elementwise
    from paged_llm.ops.elementwise import triton as fused

    x = torch.randn(3, 8)
    assert elementwise.rms_norm_for(x.device) is rms_norm_reference
    torch.testing.assert_close(elementwise.rms_norm(x, torch.ones(8), 1e-6),
                               rms_norm_reference(x, torch.ones(8), 1e-6))  # fmt: skip
    chosen = [elementwise.rms_norm_for("cuda"), elementwise.rotary_for("cuda"),
              elementwise.silu_mul_for("cuda")]  # fmt: skip
    assert chosen == [fused.rms_norm_fused, fused.rotary_fused, fused.silu_mul_fused]
    os.environ["PAGED_LLM_FUSED_ELEMENTWISE"] = "0"
    try:
        assert elementwise.silu_mul_for("cuda") is silu_mul_reference
    finally:
        del os.environ["PAGED_LLM_FUSED_ELEMENTWISE"]


def test_layers_bind_their_op_when_placed_and_the_fused_one_matches(monkeypatch):
    """A layer picks its op when built and again when its tensors move (``_apply``), and calls
    it directly; bound to the fused ops (here in Triton's interpreter), the layers' outputs
    equal the reference's."""
    from types import SimpleNamespace

    from paged_llm.layers.norms import RMSNorm
    from paged_llm.models.llama import LlamaMLP
    from paged_llm.ops import elementwise
    from paged_llm.ops.elementwise import triton as fused

    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=16, intermediate_size=24, hidden_act="silu")
    norm, mlp = RMSNorm(16), LlamaMLP(config, bias=False)
    assert (norm._rms_norm, mlp._silu_mul) == (rms_norm_reference, silu_mul_reference)
    x = torch.randn(5, 16)
    expected = norm(x), mlp(x)
    monkeypatch.setattr(elementwise, "fused_on", lambda device: True)  # as on CUDA
    norm, mlp = norm.to(torch.float32), mlp.to(torch.float32)  # a move re-binds
    assert (norm._rms_norm, mlp._silu_mul) == (fused.rms_norm_fused, fused.silu_mul_fused)
    torch.testing.assert_close((norm(x), mlp(x)), expected, **TOL[torch.float32])
    with torch.device("meta"):
        built = RMSNorm(16)
    assert built.to_empty(device="cpu")._rms_norm is fused.rms_norm_fused  # as the loader does
