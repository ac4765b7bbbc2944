"""Weight quantization methods end to end: GPTQ's and AWQ's error compensation beat plain
rounding on a layer with skewed inputs, every method runs on the trained test model within
its accuracy bound, and ``LLM(quantization=...)`` selects the same modules."""

import copy

import pytest
import torch
from test_models import VOCAB, _hf_model, _save
from torch import nn

from paged_llm import LLM, SamplingParams
from paged_llm.models import trained
from paged_llm.models.loader import load_model
from paged_llm.quant import apply_quantization
from paged_llm.quant.awq import AWQ, _out_channels, apply_scale, search_clip, search_scale
from paged_llm.quant.base import linears_by_block
from paged_llm.quant.calibration import calibration_windows
from paged_llm.quant.evaluation import (
    divergence,
    linear_weight_bytes,
    next_token_logprobs,
    perplexity,
)
from paged_llm.quant.gptq import gptq_quantize
from paged_llm.quant.int4 import dequantize_codes, fake_quantize
from paged_llm.quant.layers import Fp8Linear, Int4Linear, Int8Linear
from paged_llm.recipes.training import eval_windows

PROMPTS = ["def main():\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self"]


def _skewed_layer(seed=0, k=128, n=64, t=512):
    """Inputs with correlated channels and a few large ones (as in real LLM activations)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    x = torch.randn(t, k, generator=gen) @ mix
    x[:, :4] *= 10  # salient channels
    w = torch.randn(n, k, generator=gen) * 0.05
    return x, w


def _output_error(x, w, wq):
    return (x @ (wq - w).t()).pow(2).mean().item()


def test_gptq_beats_round_to_nearest_on_the_layer_output():
    x, w = _skewed_layer()
    rtn = _output_error(x, w, fake_quantize(w, 32))
    codes, scales, zeros = gptq_quantize(w, x.t() @ x, 32)
    gptq = _output_error(x, w, dequantize_codes(codes, scales, zeros, 32))
    assert gptq < 0.7 * rtn


def test_awq_scaling_and_clipping_beat_round_to_nearest():
    x, w = _skewed_layer(1)
    rtn = _output_error(x, w, fake_quantize(w, 32))
    s = search_scale(x, w, 32)
    scaled = _output_error(x, w, fake_quantize(w * s, 32) / s)
    clipped = _output_error(x, w, fake_quantize(search_clip(x / s, w * s, 32), 32) / s)
    assert clipped <= scaled < rtn


@pytest.fixture(scope="module")
def target():
    """(model dir, float model, held-out windows, calibration windows) of the test target."""
    d = trained.trained_model_dir("test-target")
    model, _ = load_model(d, torch.float32)
    heldout = eval_windows(trained.corpus_tokens("test-target", "heldout"), 64, 16)
    calib = calibration_windows(trained.corpus_tokens("test-target", "train"), 16, 64)
    return d, model, heldout, calib


METHODS = {
    "int8": ("int8", Int8Linear, 0.01),
    "fp8": ("fp8", Fp8Linear, 0.02),
    "int4_rtn": ({"_target_": "paged_llm.quant.simple.Int4RTN", "group_size": 64}, Int4Linear, 0.1),
    "int4_gptq": ({"_target_": "paged_llm.quant.gptq.GPTQ", "group_size": 64}, Int4Linear, 0.1),
    "int4_awq": ({"_target_": "paged_llm.quant.awq.AWQ", "group_size": 64}, Int4Linear, 0.1),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_methods_on_the_trained_test_model(target, name):
    _, model, heldout, calib = target
    spec, layer_cls, max_rise = METHODS[name]
    base = perplexity(model, heldout)
    q = apply_quantization(copy.deepcopy(model), spec, calibration=calib)
    assert isinstance(q.model.layers[0].mlp.down_proj, layer_cls)
    assert type(q.lm_head) is nn.Linear  # the LM head stays in float
    assert perplexity(q, heldout) <= base * (1 + max_rise)
    sizes = linear_weight_bytes(q)
    assert (
        sizes["weight_bytes"]
        <= (0.3 if layer_cls is Int4Linear else 0.55) * sizes["fp16_weight_bytes"]
    )


def test_gptq_and_awq_track_the_float_model_closer_than_rtn(target):
    """KL divergence from the float model's next-token distributions: far more sensitive than
    perplexity, which barely moves for a model this small."""
    _, model, heldout, calib = target
    reference = next_token_logprobs(model, heldout)
    kl = {}
    for name in ("int4_rtn", "int4_gptq", "int4_awq"):
        q = apply_quantization(copy.deepcopy(model), METHODS[name][0], calibration=calib)
        kl[name] = divergence(reference, next_token_logprobs(q, heldout))["kl_divergence"]
    assert kl["int4_gptq"] < 0.5 * kl["int4_rtn"]
    assert kl["int4_awq"] < kl["int4_rtn"]


def test_llm_quantization_argument_selects_the_modules(target):
    d = str(target[0])
    kw = {"cpu_kv_cache_gib": 0.01, "max_model_len": 64}
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = [o.outputs[0].token_ids for o in LLM(d, **kw).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(d, quantization="int8", **kw)
    assert isinstance(llm.llm_engine.model.model.layers[1].self_attn.q_proj, Int8Linear)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    agree = sum(a == b for r, o in zip(ref, out) for a, b in zip(r, o)) / sum(map(len, ref))
    assert agree >= 0.8
    # A {_target_: ...} mapping (as a Hydra group file writes it); GPTQ calibrates on the
    # stdlib corpus through the model's tokenizer when no calibration data is given.
    spec = {"_target_": "paged_llm.quant.gptq.GPTQ", "group_size": 32, "num_samples": 4,
            "seq_len": 32}  # fmt: skip
    llm = LLM(d, quantization=spec, **kw)
    assert isinstance(llm.llm_engine.model.model.layers[0].mlp.up_proj, Int4Linear)
    assert llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids


def test_prequantized_names_need_a_prequantized_checkpoint(target):
    with pytest.raises(ValueError, match="no quantization_config.*int4_gptq"):
        LLM(str(target[0]), quantization="gptq", cpu_kv_cache_gib=0.01)


# AWQ's scaling plans per family: pre-LN OPT (the paper's models; ReLU, so fc1 -> fc2 scales
# too), post-LN OPT-350m (no norm before q/k/v), GPT-2 and GPT-NeoX (GELU: fc -> proj is
# skipped), Llama under GQA (v -> o skipped), Qwen3 (q/k norms after the projections).
AWQ_FAMILIES = ["llama-gqa", "qwen3", "opt", "opt-350m-like", "gpt2", "gpt-neox",
                "gpt-neox-sequential"]  # fmt: skip


def _tiny(case, tmp_path):
    model, _ = load_model(_save(_hf_model(case), tmp_path), torch.float32)
    windows = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(1))
    return model, windows


@pytest.mark.parametrize("case", AWQ_FAMILIES)
def test_awq_scaling_plans_keep_the_float_function(case, tmp_path):
    """Every pair a plan scales (random scales on the group's inputs, their inverse folded into
    the layer before) leaves the model's predictions unchanged: the plan only pairs layers a
    scale can cross."""
    model, windows = _tiny(case, tmp_path)
    before = next_token_logprobs(model, windows)
    gen = torch.Generator().manual_seed(0)
    scaled = []
    for block in linears_by_block(model):
        for prev_name, group in AWQ()._plan(model, block):
            prev = model.get_submodule(f"{block}.{prev_name}")
            linears = [model.get_submodule(f"{block}.{n}") for n in group]
            if _out_channels(prev) != linears[0].in_features:
                continue  # as AWQ does (grouped-query v -> o)
            apply_scale(prev, linears, torch.exp(0.5 * torch.randn(_out_channels(prev),
                                                                    generator=gen)))  # fmt: skip
            scaled.append(prev_name)
    assert scaled  # every family scales something
    after = next_token_logprobs(model, windows)
    assert max((a - b).abs().max().item() for a, b in zip(after, before)) < 1e-4


@pytest.mark.parametrize("case", ["opt", "gpt2", "gpt-neox"])
def test_awq_quantizes_the_gpt_families_closer_than_rtn(case, tmp_path):
    model, windows = _tiny(case, tmp_path)
    reference = next_token_logprobs(model, windows)
    kl = {}
    for name, target in [("rtn", "paged_llm.quant.simple.Int4RTN"),
                         ("awq", "paged_llm.quant.awq.AWQ")]:  # fmt: skip
        spec = {"_target_": target, "group_size": 32}
        q = apply_quantization(copy.deepcopy(model), spec, calibration=windows)
        layers = [q.get_submodule(n) for names in linears_by_block(model).values() for n in names]
        assert layers and all(isinstance(lin, Int4Linear) for lin in layers)
        kl[name] = divergence(reference, next_token_logprobs(q, windows))["kl_divergence"]
    assert kl["awq"] < kl["rtn"]
