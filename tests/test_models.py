"""Model implementations vs transformers: tiny random checkpoints of every supported
architecture are saved with HF's own classes, loaded with our loader, and run through the
paged KV cache (shuffled block tables, decodes-first mixed batches, chunked prefill)."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_llm.attention.metadata import build_attention_metadata
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.layers.attention import ForwardContext
from paged_llm.layers.rope_scaling import compute_inv_freq, rope_parameters
from paged_llm.layers.rotary import RotaryEmbedding
from paged_llm.models import presets
from paged_llm.models.loader import (
    kv_cache_shape_info,
    load_model,
    max_context_len,
    resolve_dtype,
)
from paged_llm.models.presets import (
    build_random_model,
    count_parameters,
    default_model_dir,
    materialize_preset,
    preset_config,
)
from paged_llm.models.registry import get_model_class, supported_architectures
from paged_llm.models.tokenizer_builder import build_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 256
ATOL = 1e-4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, max_position_embeddings=128)
LLAMA_LIKE = dict(SMALL, intermediate_size=128, num_attention_heads=4)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # Small so the scaling changes most frequencies of a 16-wide head.
    original_max_position_embeddings=16,
    rope_theta=10000.0,
)


def _config(name: str):
    """The tiny HF config of test case ``name``."""
    t = transformers
    cases = {
        "llama": lambda: t.LlamaConfig(**LLAMA_LIKE, num_key_value_heads=4),
        "llama-gqa": lambda: t.LlamaConfig(**LLAMA_LIKE, num_key_value_heads=2),
        "llama-bias-headdim": lambda: t.LlamaConfig(
            **LLAMA_LIKE, num_key_value_heads=2, head_dim=32, attention_bias=True, mlp_bias=True
        ),
        "llama3-rope": lambda: t.LlamaConfig(
            **LLAMA_LIKE, num_key_value_heads=2, rope_parameters=dict(LLAMA3_ROPE)
        ),
        "llama-linear-rope": lambda: t.LlamaConfig(
            **LLAMA_LIKE, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
        ),
        "llama-tied": lambda: t.LlamaConfig(
            **LLAMA_LIKE, num_key_value_heads=2, tie_word_embeddings=True
        ),
        "mistral": lambda: t.MistralConfig(**LLAMA_LIKE, num_key_value_heads=2),
        # Windows shorter than the prompts: 4 = one block of the harness, 6 ends mid-block;
        # Qwen2's max_window_layers=1 leaves layer 0 on full attention.
        "mistral-sliding": lambda: t.MistralConfig(
            **LLAMA_LIKE, num_key_value_heads=2, sliding_window=4
        ),
        "qwen2-sliding": lambda: t.Qwen2Config(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        ),  # fmt: skip
        "mixtral-sliding": lambda: t.MixtralConfig(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
        ),
        # Qwen2-MoE's layer_types alternate: layer 0 windowed, layer 1 full attention.
        "qwen2-moe-sliding": lambda: t.Qwen2MoeConfig(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            use_sliding_window=True,
            sliding_window=6,
        ),
        "qwen2": lambda: t.Qwen2Config(
            **LLAMA_LIKE, num_key_value_heads=2, tie_word_embeddings=True
        ),
        "qwen3": lambda: t.Qwen3Config(**LLAMA_LIKE, num_key_value_heads=2, head_dim=32),
        "mixtral": lambda: t.MixtralConfig(
            **LLAMA_LIKE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        ),
        # Layer 0 dense (mlp_only_layers), layer 1 sparse with the shared expert.
        "qwen2-moe": lambda: t.Qwen2MoeConfig(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[0],
        ),
        "qwen3-moe": lambda: t.Qwen3MoeConfig(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            norm_topk_prob=True,
        ),
        "opt": lambda: t.OPTConfig(**SMALL, num_attention_heads=4, ffn_dim=128),
        "opt-350m-like": lambda: t.OPTConfig(
            **SMALL,
            num_attention_heads=4,
            ffn_dim=128,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
        ),
        "gpt2": lambda: t.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128
        ),  # fmt: skip
        # Stanford CRFM's stabilised runs scale attention by 1 / (layer + 1) too
        "gpt2-layer-scaled": lambda: t.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            n_inner=96,
            scale_attn_by_inverse_layer_idx=True,
            activation_function="gelu",
        ),  # fmt: skip
        # Pythia: parallel residual, RoPE on a quarter of each 16-wide head
        "gpt-neox": lambda: t.GPTNeoXConfig(**LLAMA_LIKE, rotary_pct=0.25),
        "gpt-neox-sequential": lambda: t.GPTNeoXConfig(
            **LLAMA_LIKE, rotary_pct=0.5, use_parallel_residual=False, tie_word_embeddings=True
        ),
    }
    config = cases[name]()
    config.architectures = [ARCHITECTURE_OF[config.model_type]]
    return config


ARCHITECTURE_OF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "opt": "OPTForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
}


def _hf_model(name: str, seed: int = 0):
    """A transformers model for case ``name`` with every parameter randomised.

    HF's init leaves biases at 0 and norm weights at 1 and uses std 0.02, under which attention
    is nearly uniform; the extra noise makes position or bias mistakes show in the logits.
    """
    config = _config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _save(hf_model, out_dir: Path, **kwargs) -> Path:
    hf_model.save_pretrained(str(out_dir), **kwargs)
    return out_dir


class PagedHarness:
    """Runs our model step by step over a paged KV cache, like the engine would."""

    def __init__(self, model, hf_config, dtype=torch.float32, num_blocks=48, block_size=4):
        layers, kv_heads, head_dim = kv_cache_shape_info(hf_config)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(layers)
        ]
        self.model = model
        self.vocab_size = hf_config.vocab_size
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(1).shuffle(self.free_blocks)  # non-contiguous, out-of-order block ids
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed each (seq_id, new tokens) chunk (decodes first); return each chunk's logits."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq_id, new in chunks:
            past = self.tokens.setdefault(seq_id, [])
            table = self.tables.setdefault(seq_id, [])
            total = len(past) + len(new)
            while len(table) * self.block_size < total:
                table.append(self.free_blocks.pop())
            ids += new
            positions += range(len(past), total)
            past += new
            query_lens.append(len(new))
            seq_lens.append(total)
            tables.append(list(table))
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.block_size)
        ctx = ForwardContext(meta, TorchAttentionBackend(), self.kv_caches)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.vocab_size)
        return list(logits.split(query_lens))


@torch.no_grad()
def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), V] from transformers on the whole sequence."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


def _prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _check_matches_hf(model, hf_config, hf_model, decode_steps: int = 4) -> None:
    """Prefill a batch of ragged prompts, then decode greedily while a late prompt joins in two
    chunks; every step's logits must match transformers run on the full sequences."""
    runner = PagedHarness(model, hf_config)
    prompts = _prompts([5, 11, 3])
    late_prompt = _prompts([10], seed=1)[0]

    def check(seq_id: int, logits: torch.Tensor) -> None:
        expected = _hf_logits(hf_model, runner.tokens[seq_id])[-logits.shape[0] :]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)

    outs = runner.step(list(enumerate(prompts)))
    for seq_id, logits in enumerate(outs):
        check(seq_id, logits)
    last = {seq_id: logits[-1] for seq_id, logits in enumerate(outs)}
    for step in range(decode_steps):
        chunks = [(s, [int(last[s].argmax())]) for s in sorted(last)]
        if step == 1:
            chunks.append((3, late_prompt[:6]))  # prefill chunk 1 of the late prompt
        elif step == 2:
            chunks.append((3, late_prompt[6:]))  # chunk 2: its prefix is already cached
        for (seq_id, _), logits in zip(chunks, runner.step(chunks)):
            check(seq_id, logits)
            if step != 1 or seq_id != 3:  # a half-prefilled sequence cannot decode yet
                last[seq_id] = logits[-1]


CASES = [
    "llama",
    "llama-gqa",
    "llama-bias-headdim",
    "llama3-rope",
    "llama-linear-rope",
    "llama-tied",
    "mistral",
    "mistral-sliding",
    "qwen2",
    "qwen2-sliding",
    "qwen3",
    "mixtral",
    "mixtral-sliding",
    "qwen2-moe",
    "qwen2-moe-sliding",
    "qwen3-moe",
    "opt",
    "opt-350m-like",
    "gpt2",
    "gpt2-layer-scaled",
    "gpt-neox",
    "gpt-neox-sequential",
]


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_fp32(case, tmp_path):
    hf_model = _hf_model(case)
    model, hf_config = load_model(_save(hf_model, tmp_path), torch.float32, "cpu")
    assert type(model).__name__ == hf_config.architectures[0]
    _check_matches_hf(model, hf_config, hf_model)


@pytest.mark.parametrize(
    "case, backend",
    [("gpt2", "torch"), ("gpt2", "cpu"), ("gpt-neox", "cpu"), ("gpt-neox-sequential", "triton")],
)
def test_gpt_families_generate_like_transformers(case, backend, tmp_path):
    """GPT-2 and GPT-NeoX through the whole engine: greedy ids equal transformers' generate."""
    from test_engine import generate_ids, hf_greedy

    from paged_llm import LLM

    hf_model = _hf_model(case)
    llm = LLM(str(_save(hf_model, tmp_path)), block_size=4, cpu_kv_cache_gib=0.01,
              attention_backend=backend)  # fmt: skip
    prompts = _prompts([5, 11, 3, 17], seed=2)
    assert generate_ids(llm, prompts, 8) == [hf_greedy(hf_model, p, 8) for p in prompts]


def test_gpt2_checkpoint_without_prefix_and_with_mask_buffers(tmp_path):
    # openai-community/gpt2 was saved from GPT2Model: "h.0.attn.c_attn.weight", plus the
    # causal-mask buffers "h.0.attn.bias" / "h.0.attn.masked_bias" of older transformers
    hf_model = _hf_model("gpt2")
    hf_model.config.save_pretrained(str(tmp_path))
    state = {k.removeprefix("transformer."): v.clone() for k, v in hf_model.state_dict().items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(tmp_path / "model.safetensors"))
    model, hf_config = load_model(tmp_path)
    _check_matches_hf(model, hf_config, hf_model, decode_steps=1)


def test_tied_embeddings_share_storage(tmp_path):
    _save(_hf_model("llama-tied"), tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model, _ = load_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_safetensors(tmp_path):
    hf_model = _hf_model("llama-gqa")
    _save(hf_model, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model, hf_config = load_model(tmp_path)
    _check_matches_hf(model, hf_config, hf_model, decode_steps=1)


@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_bin_checkpoints(tmp_path, sharded):
    # transformers 5 always writes safetensors, so the .bin layouts are written by hand.
    hf_model = _hf_model("qwen2")
    hf_model.config.save_pretrained(str(tmp_path))
    state = hf_model.state_dict()
    if not sharded:
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        names = sorted(state)
        shards = {"pytorch_model-00001-of-00002.bin": names[::2]}
        shards["pytorch_model-00002-of-00002.bin"] = names[1::2]
        weight_map = {}
        for file, keys in shards.items():
            torch.save({k: state[k] for k in keys}, tmp_path / file)
            weight_map.update(dict.fromkeys(keys, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    model, hf_config = load_model(tmp_path)
    _check_matches_hf(model, hf_config, hf_model, decode_steps=1)


def test_opt_checkpoint_without_model_prefix(tmp_path):
    # facebook/opt-* checkpoints were saved from OPTModel: "decoder.*", plus a tied lm_head copy.
    hf_model = _hf_model("opt")
    hf_model.config.save_pretrained(str(tmp_path))
    state = {k.removeprefix("model."): v.clone() for k, v in hf_model.state_dict().items()}
    assert "decoder.embed_tokens.weight" in state and "lm_head.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    model, hf_config = load_model(tmp_path)
    _check_matches_hf(model, hf_config, hf_model, decode_steps=1)


@pytest.mark.parametrize("case", ["llama-gqa", "opt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_smoke(tmp_path, case, dtype):
    _save(_hf_model(case), tmp_path)
    ref_model, hf_config = load_model(tmp_path, torch.float32)
    model, _ = load_model(tmp_path, dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    prompts = list(enumerate(_prompts([5, 11, 3])))
    ref = torch.cat(PagedHarness(ref_model, hf_config).step(prompts))
    out = torch.cat(PagedHarness(model, hf_config, dtype=dtype).step(prompts))
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()


def test_rope_frequencies_stay_fp32_after_dtype_cast():
    params = rope_parameters(_config("llama3-rope"))
    rope = RotaryEmbedding(16, params).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq, compute_inv_freq(16, params), atol=0, rtol=0)


@pytest.mark.parametrize("case", ["llama", "llama3-rope", "llama-linear-rope"])
def test_inv_freq_matches_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _config(case)
    params = rope_parameters(config)
    ours = compute_inv_freq(16, params)
    if params["rope_type"] == "default":
        expected = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)


def test_rope_parameters_from_transformers_4_style_config():
    class Old:  # what a transformers 4.x config exposes
        max_position_embeddings = 4096
        rope_theta = 5e5
        rope_scaling = {"type": "linear", "factor": 4.0}

    params = rope_parameters(Old())
    assert params["rope_type"] == "linear" and params["rope_theta"] == 5e5


# ---------------------------------------------------------------------------- loader errors


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    config = transformers.BloomConfig(
        n_layer=1, hidden_size=32, n_head=2, vocab_size=64, architectures=["BloomForCausalLM"]
    )
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="BloomForCausalLM.*LlamaForCausalLM"):
        load_model(tmp_path)


def test_missing_architectures_field(tmp_path):
    config = _config("llama")
    config.architectures = None
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="architectures is missing"):
        load_model(tmp_path)


def test_missing_weights(tmp_path):
    _config("llama").save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no weights found"):
        load_model(tmp_path)


def _resave(tmp_path: Path, edit) -> None:
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def test_missing_tensor(tmp_path):
    _save(_hf_model("llama"), tmp_path)
    _resave(tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


def test_unexpected_tensor(tmp_path):
    _save(_hf_model("llama"), tmp_path)
    _resave(tmp_path, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected.*model.layers.0.extra.weight"):
        load_model(tmp_path)


def test_shape_mismatch(tmp_path):
    _save(_hf_model("llama"), tmp_path)
    _resave(tmp_path, lambda s: s.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match="shape mismatch for 'model.norm.weight'"):
        load_model(tmp_path)


def test_rotary_buffers_in_checkpoint_are_ignored(tmp_path):
    _save(_hf_model("llama"), tmp_path)
    inv_freq = torch.ones(8)
    _resave(
        tmp_path, lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq})
    )
    load_model(tmp_path)


def test_untied_checkpoint_without_lm_head_falls_back_to_tying(tmp_path, caplog):
    _save(_hf_model("llama"), tmp_path)
    _resave(tmp_path, lambda s: s.pop("lm_head.weight"))
    with caplog.at_level(logging.WARNING):
        model, _ = load_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" in caplog.text


def test_registry():
    bases = ["Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral", "Qwen2Moe", "Qwen3Moe", "OPT"]
    bare = {f"{b}Model" for b in ["Llama", "Mistral", "Qwen2", "Qwen3", "OPT"]}
    gpts = {"GPT2LMHeadModel", "GPTNeoXForCausalLM", "GPT2ForSequenceClassification",
            "GPTNeoXForSequenceClassification"}  # fmt: skip
    assert set(supported_architectures()) == bare | gpts | {
        f"{b}For{head}" for b in bases for head in ("CausalLM", "SequenceClassification")
    }
    for arch in supported_architectures():  # every name resolves to its class
        config = transformers.LlamaConfig()
        config.architectures = [arch]
        name = get_model_class(config).__name__
        assert name == (arch.replace("Model", "EmbeddingModel") if arch in bare else arch)
    config = _config("qwen2")
    config.architectures = ["SomethingElse", "Qwen2ForCausalLM"]
    assert get_model_class(config).__name__ == "Qwen2ForCausalLM"


def test_resolve_dtype():
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("auto", preset_config("opt-125m")) is torch.float32
    assert resolve_dtype("auto", transformers.LlamaConfig(dtype="bfloat16")) is torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8")


def test_kv_cache_shape_and_context_len():
    assert kv_cache_shape_info(_config("llama-bias-headdim")) == (2, 2, 32)
    assert kv_cache_shape_info(_config("opt")) == (2, 4, 16)
    assert kv_cache_shape_info(preset_config("llama-7b")) == (32, 32, 128)
    assert max_context_len(_config("opt")) == 128
    # A sliding window no longer caps the context: windowed layers run at any length.
    assert max_context_len(_config("mistral-sliding")) == 128


@pytest.mark.parametrize(
    "case, windows",
    [
        ("llama", [None, None]),
        ("opt", [None, None]),
        ("mistral", [4096, 4096]),
        ("mistral-sliding", [4, 4]),
        ("qwen2", [None, None]),  # a window is stored but use_sliding_window is off
        ("qwen2-sliding", [None, 6]),  # layer_types: full below max_window_layers
        ("mixtral", [None, None]),
        ("mixtral-sliding", [5, 5]),
        ("qwen2-moe-sliding", [6, None]),
    ],
)
def test_sliding_window_per_layer(case, windows):
    from paged_llm.models.loader import sliding_window_of

    config = _config(case)
    assert [sliding_window_of(config, i) for i in range(2)] == windows
    model, _ = build_random_model(config, device="meta")
    layers = [m for m in model.modules() if type(m).__name__ == "PagedAttention"]
    assert [layer.sliding_window for layer in layers] == windows


# ---------------------------------------------------------------------------- presets


@pytest.mark.parametrize("case", CASES)
def test_count_parameters_matches_modules(case):
    model, config = build_random_model(_config(case), device="meta")
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config)


def test_big_preset_shapes_arithmetic():
    # Published sizes; the 7B/13B models are never instantiated in tests.
    expected = {
        "opt-1.3b": 1_315_758_080,
        "opt-2.7b": 2_651_596_800,
        "opt-6.7b": 6_658_473_984,
        "opt-13b": 12_853_473_280,
        "llama-7b": 6_738_415_616,
        "llama-13b": 13_015_864_320,
    }
    for name, num in expected.items():
        assert count_parameters(preset_config(name)) == num, name
    with pytest.raises(ValueError, match="build_random_model"):
        materialize_preset("llama-7b", "/nonexistent")
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_config("gpt-5")


def test_build_random_opt_125m():
    model, config = build_random_model("opt-125m", torch.bfloat16, "cpu")
    assert sum(p.numel() for p in model.parameters()) == 125_239_296 == count_parameters(config)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    norm = model.model.decoder.layers[0].final_layer_norm
    assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)
    assert 0.015 < model.model.decoder.layers[0].fc1.weight.float().std() < 0.025


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_default_model_materializes_and_loads(cache_dir):
    path = default_model_dir()
    assert path.parent == cache_dir and default_model_dir() == path
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    model, hf_config = load_model(path)
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 2e6
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert len(tokenizer) <= hf_config.vocab_size
    assert tokenizer.eos_token_id == hf_config.eos_token_id
    text = "def add(a, b):\n    return a + b"
    ids = tokenizer(text).input_ids
    assert ids[0] == hf_config.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    runner = PagedHarness(model, hf_config)
    (logits,) = runner.step([(0, ids)])
    assert torch.isfinite(logits).all()


def test_default_model_dir_lost_race(cache_dir, monkeypatch):
    """Another process finishing first must not make us fail, nor leave temp dirs behind."""
    real = presets.materialize_preset

    def racing(name, out_dir, **kwargs):
        real(name, cache_dir / f"tiny-llama-{presets.TINY_CACHE_VERSION}")  # the "other" one
        return real(name, out_dir, **kwargs)

    monkeypatch.setattr(presets, "materialize_preset", racing)
    path = default_model_dir()
    assert (path / "config.json").is_file()
    assert os.listdir(cache_dir) == [path.name]


def test_tokenizer_is_deterministic(tmp_path):
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    a = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert a == (tmp_path / "b" / "tokenizer.json").read_bytes()
