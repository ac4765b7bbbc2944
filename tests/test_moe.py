"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) and Qwen3 in the engine: greedy
generation equals transformers' ``generate`` (also with chunked prefill and preemption), the
per-expert checkpoint tensors are stacked or refused, and unsupported combinations fail early.
Logit parity per step is in tests/test_models.py; the fused kernel's in test_moe_kernels.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine import generate_ids, hf_greedy

from paged_llm import LLM, SamplingParams
from paged_llm.layers.moe import FusedExperts, stack_expert_weights
from paged_llm.models.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(5)]  # lengths 5..25
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=96,
    max_position_embeddings=256,
    initializer_range=0.2,  # peaky logits, so greedy choices are not near-ties
)


def _config(kind: str):
    t = transformers
    configs = {
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=32),
        "mixtral": lambda: t.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
        "qwen2-moe": lambda: t.Qwen2MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=2,  # layer 0 dense, layer 1 sparse
        ),
        "qwen3-moe": lambda: t.Qwen3MoeConfig(
            **COMMON,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),  # fmt: skip
    }
    return configs[kind]()


def _save(kind: str, path) -> tuple[str, object]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).eval()
    model.save_pretrained(str(path))
    return str(path), model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _save("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "qwen2-moe", "qwen3-moe"])
def test_greedy_matches_transformers_generate(kind, tmp_path):
    path, hf = _save(kind, tmp_path)
    llm = LLM(path, block_size=4, cpu_kv_cache_gib=0.01)
    assert generate_ids(llm, PROMPTS, 10) == [hf_greedy(hf, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_chunked_prefill_keep_outputs(mixtral, mode):
    path, hf = mixtral
    llm = LLM(
        path, block_size=4, num_gpu_blocks_override=14, max_model_len=40, preemption_mode=mode,
        swap_space=0.01, enable_chunked_prefill=True, max_num_batched_tokens=8,
    )  # fmt: skip
    assert generate_ids(llm, PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_prefix_caching=True),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
        dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
        dict(kv_cache_dtype="int8"),
    ],
    ids=["prefix-cache", "ngram", "self-draft", "int8-kv"],
)
def test_engine_features_keep_outputs(mixtral, settings):
    """Prefix caching and speculation (n-gram, and the MoE drafting for itself) give the plain
    engine's greedy tokens; an int8 KV cache runs and mostly agrees."""
    path, _ = mixtral
    if "speculative_config" in settings and settings["speculative_config"]["method"] != "ngram":
        settings = {"speculative_config": {**settings["speculative_config"], "model": path}}
    prompts = PROMPTS + [PROMPTS[4][:20] + [7, 7]]  # shares 20 tokens (5 blocks) with PROMPTS[4]
    expected = generate_ids(LLM(path, block_size=4, cpu_kv_cache_gib=0.01), prompts, 10)
    llm = LLM(path, block_size=4, cpu_kv_cache_gib=0.01, **settings)
    ours = generate_ids(llm, prompts, 10)
    if "kv_cache_dtype" in settings:
        same = sum(a == b for x, y in zip(ours, expected) for a, b in zip(x, y))
        assert same >= 0.8 * sum(len(x) for x in expected)
    else:
        assert ours == expected
    if "speculative_config" in settings:
        assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    if settings.get("enable_prefix_caching"):  # the second pass finds the first one's blocks
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 4)


def test_experts_are_stacked_in_transformers_layout(mixtral):
    path, hf = mixtral
    model, _ = load_model(path)
    ours = model.model.layers[1].mlp
    theirs = hf.model.layers[1].mlp
    assert isinstance(ours.experts, FusedExperts)
    torch.testing.assert_close(ours.experts.gate_up_proj, theirs.experts.gate_up_proj)
    torch.testing.assert_close(ours.experts.down_proj, theirs.experts.down_proj)
    torch.testing.assert_close(ours.gate.weight, theirs.gate.weight)


def test_stacking_refuses_missing_or_extra_experts():
    def tensors(experts):
        for e in experts:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"model.layers.0.mlp.experts.{e}.{proj}.weight", torch.zeros(2, 2)

    stacked = dict(stack_expert_weights(tensors(range(3)), num_experts=3))
    assert stacked["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 4, 2)
    assert stacked["model.layers.0.mlp.experts.down_proj"].shape == (3, 2, 2)
    with pytest.raises(ValueError, match=r"lacks expert tensors.*2\.gate_proj"):
        dict(stack_expert_weights(tensors(range(2)), num_experts=3))
    with pytest.raises(ValueError, match="names expert 3, but the config has 3 experts"):
        dict(stack_expert_weights(tensors(range(4)), num_experts=3))


def test_checkpoint_missing_an_expert_is_refused(mixtral, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = mixtral
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((Path(path) / name).read_text())
    weights = load_file(str(Path(path) / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts.*5\.up_proj"):
        LLM(str(tmp_path), cpu_kv_cache_gib=0.01)


@pytest.mark.parametrize("method", ["int4_gptq", "int4_awq"])
def test_weight_quantization_without_expert_support_is_refused(mixtral, method):
    with pytest.raises(ValueError, match="does not support mixture-of-experts"):
        LLM(mixtral[0], quantization=method, cpu_kv_cache_gib=0.01)


INT4_32 = {"_target_": "paged_llm.quant.simple.Int4RTN", "group_size": 32}
# method -> (stored expert dtype, down_scale shape, weight bytes at most this share of fp16's)
QUANTIZED_EXPERTS = {
    "int8": (torch.int8, (8, 64), 0.55),  # 1 byte + a scale per row
    "fp8": (torch.float8_e4m3fn, (8, 64), 0.55),
    "int4_rtn": (torch.uint8, (8, 64, 96 // 32), 0.35),  # half a byte + scale and zero per 32
}


@pytest.mark.parametrize("method", sorted(QUANTIZED_EXPERTS))
def test_quantized_experts_equal_transformers_on_the_dequantized_weights(mixtral, method):
    """quantization="int8" / "fp8" / "int4_rtn" on a Mixtral: attention and expert weights
    become int8 / fp8 e4m3 / int4 (routers stay float), and greedy tokens equal transformers'
    Mixtral holding the dequantized weights."""
    from paged_llm.ops.moe.reference import expert_weight
    from paged_llm.quant.evaluation import linear_weight_bytes
    from paged_llm.quant.layers import QuantLinear

    path, _ = mixtral
    spec = INT4_32 if method == "int4_rtn" else method
    llm = LLM(path, quantization=spec, block_size=4, cpu_kv_cache_gib=0.01)
    model = llm.llm_engine.model
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear):
                hf.get_submodule(name).weight.copy_(module.dequantize())
            elif isinstance(module, FusedExperts):
                theirs = hf.get_submodule(name)
                for proj in ("gate_up", "down"):
                    w, scale, zero = (getattr(module, f"{proj}_{part}")
                                      for part in ("proj", "scale", "zero"))  # fmt: skip
                    plain = [expert_weight(w, scale, e, torch.float32, zero) for e in range(8)]
                    getattr(theirs, f"{proj}_proj").copy_(torch.stack(plain))
    experts = model.model.layers[0].mlp.experts
    stored, down_scale_shape, max_share = QUANTIZED_EXPERTS[method]
    assert experts.gate_up_proj.dtype == stored and experts.down_scale.shape == down_scale_shape
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays
    assert generate_ids(llm, PROMPTS, 10) == [hf_greedy(hf, p, 10) for p in PROMPTS]
    sizes = linear_weight_bytes(model)
    assert sizes["weight_bytes"] < max_share * sizes["fp16_weight_bytes"]


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_prequantized_moe_checkpoints_load(mixtral, tmp_path, fmt):
    """An int4 Mixtral written as a GPTQ / AWQ checkpoint holds one int4 layer per expert and
    projection under Mixtral's names (block_sparse_moe.experts.<e>.w1/w3/w2), as AutoGPTQ and
    AutoAWQ write them. Loaded, the experts are stacked again, and greedy tokens equal the
    in-memory int4 engine's and transformers' Mixtral holding the file's dequantized weights."""
    from safetensors.torch import load_file, save_file

    from paged_llm.quant.checkpoint import save_quantized
    from paged_llm.quant.packing import dequantize_awq_reference, dequantize_gptq_reference

    path, _ = mixtral
    llm = LLM(path, quantization=INT4_32, block_size=4, cpu_kv_cache_gib=0.01)
    expected = generate_ids(llm, PROMPTS, 10)
    out = save_quantized(llm.llm_engine.model, tmp_path / fmt, fmt)
    raw = load_file(str(out / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.7.w2.qweight" in raw
    assert "model.layers.1.block_sparse_moe.gate.weight" in raw  # the router, in float
    assert not [n for n in raw if "gate_up_proj" in n or ".mlp." in n]
    loaded = LLM(str(out), block_size=4, cpu_kv_cache_gib=0.01)
    experts = loaded.llm_engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.uint8 and experts.down_zero.shape == (8, 64, 3)
    assert generate_ids(loaded, PROMPTS, 10) == expected

    def plain(name):  # [N, K] from the file's tensors, nibble by nibble
        if fmt == "gptq":
            t = [raw[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")]
            return dequantize_gptq_reference(*t, zero_offset=1)
        t = [raw[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales")]
        return dequantize_awq_reference(*t, group_size=32)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for layer in range(2):
            prefix = f"model.layers.{layer}."
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                hf.get_submodule(prefix + "self_attn." + proj).weight.copy_(
                    plain(prefix + "self_attn." + proj)
                )
            moe, theirs = (
                prefix + "block_sparse_moe.experts.",
                hf.get_submodule(prefix + "mlp.experts"),
            )
            gate_up = [torch.cat([plain(f"{moe}{e}.w1"), plain(f"{moe}{e}.w3")]) for e in range(8)]
            theirs.gate_up_proj.copy_(torch.stack(gate_up))
            theirs.down_proj.copy_(torch.stack([plain(f"{moe}{e}.w2") for e in range(8)]))
    assert expected == [hf_greedy(hf, p, 10) for p in PROMPTS]
    if fmt == "gptq":  # act-order experts would need a gather the fused kernel does not do
        name = "model.layers.0.block_sparse_moe.experts.2.w2.g_idx"
        raw[name] = raw[name][torch.randperm(96, generator=torch.Generator().manual_seed(0))]
        save_file(raw, str(out / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match="experts.2.down_proj has an act-order g_idx"):
            LLM(str(out), cpu_kv_cache_gib=0.01)


@pytest.mark.parametrize("group_size, message", [(8, "power of two"), (64, "does not divide")])
def test_int4_experts_refuse_a_group_the_kernel_cannot_tile(mixtral, group_size, message):
    spec = dict(INT4_32, group_size=group_size)  # 64 divides the attention's 64 inputs, not 96
    with pytest.raises(ValueError, match=message):
        LLM(mixtral[0], quantization=spec, cpu_kv_cache_gib=0.01)


def test_unsupported_expert_activation_is_refused(tmp_path):
    config = _config("mixtral")
    config.hidden_act = "gelu"
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="hidden_act='silu' only"):
        load_model(tmp_path)


def test_lora_on_a_moe_model_matches_peft(mixtral, tmp_path):
    """Adapters on the attention projections of a Mixtral: log-probabilities equal PEFT's."""
    from test_lora import assert_prompt_logprobs_match, write_adapter

    from paged_llm.lora.request import LoRARequest

    path, _ = mixtral
    pm = write_adapter(
        path, tmp_path / "lora", ["q_proj", "v_proj", "o_proj"], r=4, alpha=8, seed=1
    )
    llm = LLM(path, enable_lora=True, max_lora_rank=8, cpu_kv_cache_gib=0.01)
    req = LoRARequest("mixtral-lora", 1, str(tmp_path / "lora"))
    assert_prompt_logprobs_match(llm, req, pm, PROMPTS[3])


def test_moe_bench_runs_and_agrees(tmp_path):
    """The benchmark's smallest run: its MoE generates transformers' tokens, and it reports
    every system and every layer row."""
    from experiments import moe_bench
    from paper_repro.common import compose

    cfg = compose("moe_bench", ["requests=2", "prompt=6", "tokens=4", "experts=2", "top_k=1",
                                "repeats=1", "layer_tokens=[1,4]", "check_prompts=2"])  # fmt: skip
    doc = moe_bench.write(cfg, tmp_path)
    assert json.loads((tmp_path / "moe_bench.json").read_text())["mode"] == "real"
    assert doc["moe_tokens_equal_transformers"] == 1.0
    assert set(doc["systems"]) == {"moe", "dense_active", "dense_total"}
    assert all(s["output_tokens_per_s"] > 0 for s in doc["systems"].values())
    assert [row["tokens"] for row in doc["layer_ms"]] == [1, 4]


def test_simulator_shapes_of_moe_models():
    """The cost model's MoE shapes: Mixtral-8x7B's published sizes; from a transformers config,
    the engine's own parameter count; FLOPs follow the active parameters, weight reads the
    experts a step's tokens touch."""
    from paged_llm.models.presets import build_random_model
    from paged_llm.sim.cost_model import RooflineCostModel, StepShape
    from paged_llm.sim.executor import SimulatedExecutor
    from paged_llm.sim.hardware import get_hardware
    from paged_llm.sim.model_shapes import from_hf_config, get_model_shape
    from paged_llm.sim.settings import ServingSettings
    from paged_llm.workloads.arrivals import WorkloadSpec, build_workload

    m = get_model_shape("mixtral-8x7b")
    assert m.num_params / 1e9 == pytest.approx(46.7, rel=0.005)
    assert m.active_params / 1e9 == pytest.approx(12.9, rel=0.01)
    dense = m.weight_bytes - 8 * m.expert_params * 2
    assert m.weight_bytes_read(1) == pytest.approx(dense + 2 * m.expert_params * 2)
    assert m.weight_bytes_read(256) == pytest.approx(m.weight_bytes, rel=1e-6)
    reads = [m.weight_bytes_read(n) for n in range(1, 40)]
    assert reads == sorted(reads) and m.linear_flops_per_token == 2 * m.active_params
    assert (
        get_model_shape("llama-13b").weight_bytes_read(1)
        == get_model_shape("llama-13b").weight_bytes
    )

    architectures = {"mixtral": "MixtralForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM",
                     "qwen3-moe": "Qwen3MoeForCausalLM"}  # fmt: skip
    for kind, arch in architectures.items():
        config = _config(kind)
        config.architectures = [arch]
        model, _ = build_random_model(config, device="meta")
        shape = from_hf_config(config)
        assert shape.num_params == sum(p.numel() for p in model.parameters())
        experts = [mod for mod in model.modules() if isinstance(mod, FusedExperts)]
        per_expert = sum(e.gate_up_proj[0].numel() + e.down_proj[0].numel() for e in experts)
        assert shape.expert_params == per_expert  # qwen2-moe: only its sparse layer

    # a decode step reads far less than the whole model at batch 1, all of it at batch 64
    cost = RooflineCostModel(get_hardware("h200"), m)
    one, many = StepShape.decode(1, 512), StepShape.decode(64, 512)
    assert cost.memory_bytes(one) < 0.4 * m.weight_bytes < m.weight_bytes < cost.memory_bytes(many)
    wl = build_workload(WorkloadSpec(request_rate=4.0, num_requests=20, duration_s=None, seed=0))
    trace = SimulatedExecutor("h200", "mixtral-8x7b").run(wl, "paged", ServingSettings())
    assert all(r.finished for r in trace.requests) and "H200" in trace.hardware


def test_a_moe_model_pools(mixtral):
    """runner="pooling" over a Mixtral: the embedding is transformers' last hidden state."""
    import torch.nn.functional as F

    path, hf = mixtral
    out = LLM(path, runner="pooling", block_size=4, cpu_kv_cache_gib=0.01).embed(
        [PROMPTS[2]], use_tqdm=False
    )[0]
    with torch.no_grad():
        h = hf.model(torch.tensor([PROMPTS[2]])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(h, dim=-1),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
