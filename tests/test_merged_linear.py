"""Sibling linears (q/k/v, gate/up) merged into one GEMM (paged_llm/layers/linear.py):
every architecture still matches transformers, the layers' parameters become views that
loading writes through, unlike layers stay apart, and the engine's outputs do not change."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine import generate_ids
from test_models import CASES, PagedHarness, _check_matches_hf, _hf_model, _prompts, _save
from torch import nn

import paged_llm.layers.rotary as rotary_module
from paged_llm import LLM, SamplingParams
from paged_llm.layers.linear import merged_groups, sibling_outputs
from paged_llm.layers.linear_setup import merge_sibling_linears
from paged_llm.layers.rotary import apply_rotary, apply_rotary_qk
from paged_llm.models.base import load_named_weights
from paged_llm.models.loader import load_model
from paged_llm.ops.elementwise.reference import rotary_reference, silu_mul_reference
from paged_llm.ops.elementwise.triton import rotary_triton, silu_mul_triton


def _groups(model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    return [(name, g) for name, m in model.named_modules() for g in merged_groups(m)]


@pytest.mark.parametrize("case", CASES)
def test_every_architecture_merges_and_still_matches_transformers(case, tmp_path):
    hf_model = _hf_model(case)
    model, hf_config = load_model(_save(hf_model, tmp_path), torch.float32, "cpu")
    merged = merge_sibling_linears(model)
    gated = any(n.endswith("gate_proj") for n, _ in model.named_modules())
    assert merged == hf_config.num_hidden_layers * (2 if gated else 1) == len(_groups(model))
    _check_matches_hf(model, hf_config, hf_model)


def _logits(model, hf_config) -> list[torch.Tensor]:
    harness = PagedHarness(model, hf_config)
    prompts = _prompts([5, 9, 3])
    out = harness.step(list(enumerate(prompts)))
    return out + harness.step([(i, [7]) for i in range(len(prompts))])


def test_merging_keeps_names_values_and_outputs_and_loading_writes_through(tmp_path):
    hf_model = _hf_model("llama-bias-headdim")  # GQA, q/k/v and MLP biases, head_dim != H / Hq
    model, hf_config = load_model(_save(hf_model, tmp_path), torch.float32, "cpu")
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_count = sum(p.numel() for p in model.parameters())
    before = _logits(model, hf_config)
    merge_sibling_linears(model)
    assert merge_sibling_linears(model) == 0  # merging again changes nothing
    state = model.state_dict()
    assert state.keys() == before_state.keys()
    assert all(torch.equal(state[k], v) for k, v in before_state.items())
    assert sum(p.numel() for p in model.parameters()) == before_count  # no second copy
    after = _logits(model, hf_config)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # one GEMM, the same sums
    attn = model.model.layers[1].self_attn
    storages = {getattr(attn, n).weight.untyped_storage().data_ptr() for n in ("q_proj", "v_proj")}
    assert len(storages) == 1
    # load_weights copies into the views: the merged GEMM sees the new rows at once
    new_k = torch.randn_like(attn.k_proj.weight)
    new_b = torch.randn_like(attn.k_proj.bias)
    prefix = "model.layers.1.self_attn.k_proj"
    load_named_weights(model, [(f"{prefix}.weight", new_k), (f"{prefix}.bias", new_b)],
                       optional=set(state))  # fmt: skip
    x = torch.randn(3, hf_config.hidden_size)
    q, k, v = sibling_outputs(attn, ("q_proj", "k_proj", "v_proj"), x)
    torch.testing.assert_close(k, nn.functional.linear(x, new_k, new_b))
    torch.testing.assert_close(q, attn.q_proj(x))
    torch.testing.assert_close(v, attn.v_proj(x))


class _Owner(nn.Module):
    sibling_linears = (("a", "b"),)

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b


class _Wrapped(nn.Linear):
    """A subclass stands for quantized and LoRA layers: it may carry state a merge would lose."""


@pytest.mark.parametrize(
    "a, b",
    [
        (_Wrapped(8, 4), nn.Linear(8, 4)),
        (nn.Linear(8, 4), nn.Linear(8, 4, bias=False)),
        (nn.Linear(8, 4), nn.Linear(8, 4, dtype=torch.float64)),
        (nn.Linear(8, 4), nn.Linear(6, 4)),
    ],
    ids=["subclass", "bias", "dtype", "input"],
)
def test_unlike_layers_stay_apart(a, b):
    owner = _Owner(a, b)
    assert merge_sibling_linears(owner) == 0 and merged_groups(owner) == []
    x = torch.randn(2, a.in_features, dtype=a.weight.dtype)
    if b.in_features == a.in_features and b.weight.dtype == a.weight.dtype:
        outs = sibling_outputs(owner, ("a", "b"), x)
        assert torch.equal(outs[0], a(x)) and torch.equal(outs[1], b(x))


def test_engine_outputs_equal_with_and_without_merging(tiny_llama):
    path, _ = tiny_llama
    prompts = _prompts([5, 11, 3, 17], seed=3)
    params = {"logprobs": 3}
    runs = {}
    for merge in (True, False):
        llm = LLM(str(path), block_size=4, cpu_kv_cache_gib=0.01, merge_sibling_linears=merge)
        model = llm.llm_engine.model
        assert len(_groups(model)) == (4 if merge else 0)  # 2 layers x (q/k/v, gate/up)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **params)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        runs[merge] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert runs[True] == runs[False]


def test_quantized_and_lora_layers_are_not_merged(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), block_size=4, cpu_kv_cache_gib=0.01, quantization="int8")
    assert _groups(llm.llm_engine.model) == []
    llm = LLM(str(path), block_size=4, cpu_kv_cache_gib=0.01, enable_lora=True, max_lora_rank=4)
    assert _groups(llm.llm_engine.model) == []
    assert generate_ids(llm, _prompts([4]), 2)  # the wrapped layers run one by one


def test_rotary_of_adjacent_q_and_k_is_one_launch():
    calls = []

    def rotate(*args):  # the layer's rotary op, counted
        calls.append(1)
        return rotary_reference(*args)

    t, hq, hk, d = 5, 4, 2, 8
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    angles = torch.rand(t, d // 2) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = apply_rotary_qk(q, k, cos, sin, rotate)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    for not_adjacent in ((q, v), (q, k.clone()), (q.clone(), k)):
        calls.clear()
        out = apply_rotary_qk(*not_adjacent, cos, sin, rotate)
        assert len(calls) == 2
        assert torch.equal(out[0], apply_rotary(not_adjacent[0], cos, sin))
    # partial rotary (GPT-NeoX): the first R channels of both in one launch
    part = cos[:, : d // 2], sin[:, : d // 2]
    calls.clear()
    out = apply_rotary_qk(q, k, *part, rotate)
    assert len(calls) == 1 and torch.equal(out[1], apply_rotary(k, *part))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_take_the_merged_outputs_column_views(dtype):
    """The fused kernels (interpreter here) read q/k and gate/up as views of one GEMM's output."""
    gen = torch.Generator().manual_seed(0)
    t, hq, hk, d, inter = 3, 4, 2, 16, 40
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)
    angles = torch.rand(t, d // 2, generator=gen) * 6
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {}
    torch.testing.assert_close(rotary_triton(qk, cos, sin), rotary_module.rotary(qk, cos, sin),
                               **tol)  # fmt: skip
    gate_up = torch.randn(t, 2 * inter, generator=gen).to(dtype)
    gate, up = gate_up.split([inter, inter], dim=-1)
    torch.testing.assert_close(silu_mul_triton(gate, up, block=32), silu_mul_reference(gate, up),
                               **tol)  # fmt: skip


def test_a_layer_replaced_after_merging_runs_its_group_one_by_one():
    """E.g. quantizing a deep copy of a merged model: the copy's new layers are the ones used."""
    owner = _Owner(nn.Linear(8, 4), nn.Linear(8, 6))
    assert merge_sibling_linears(owner) == 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(sibling_outputs(owner, ("a", "b"), x)[1], owner.b(x))
    copy_ = copy.deepcopy(owner)
    copy_.b = _Wrapped(8, 6)
    outs = sibling_outputs(copy_, ("a", "b"), x)
    assert torch.equal(outs[1], copy_.b(x)) and torch.equal(outs[0], copy_.a(x))
    # the original still runs merged, and the copy's merged weights are its own
    with torch.no_grad():
        copy_.a.weight.zero_()
    torch.testing.assert_close(sibling_outputs(owner, ("a", "b"), x)[0], owner.a(x))
    assert owner.a(x).abs().sum() > 0
