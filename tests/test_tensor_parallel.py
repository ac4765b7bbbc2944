"""Tensor parallelism on the CPU: 2 ranks over gloo give the same greedy tokens as 1 process.

Each architecture starts one 2-rank engine (spawning a worker that imports torch costs a few
seconds, so every engine is used once, with settings that exercise many paths at a time).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from paged_llm import LLM, SamplingParams
from paged_llm.beam_search import BeamSearchParams
from paged_llm.config import EngineConfig
from paged_llm.distributed import TPGroup, building_for
from paged_llm.distributed.checks import check_tensor_parallel
from paged_llm.distributed.launch import shutdown_all
from paged_llm.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_linear,
    lm_head,
    row_linear,
    vocab_embedding,
)
from paged_llm.distributed.sharding import (
    VOCAB_PADDING,
    kv_heads_per_rank,
    shard_checkpoint,
    shard_heads,
    shard_vocab,
)
from paged_llm.lora.request import LoRARequest

transformers = pytest.importorskip("transformers")
# A deadlocked collective fails the test after 3 minutes instead of hanging for 30
# (spawned and torchrun ranks inherit the variable).
os.environ.setdefault("PAGED_LLM_TP_TIMEOUT_S", "180")

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(4)]  # lengths 5..20
COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
LLAMA_LIKE = dict(COMMON, intermediate_size=128, num_hidden_layers=2, initializer_range=0.2)
INT4_32 = {"_target_": "paged_llm.quant.simple.Int4RTN", "group_size": 32}


def hf_config(kind: str):
    """Tiny configs with transformers' own classes, as tests/conftest.py save_tiny builds them."""
    t = transformers
    configs = {
        "llama": lambda: t.LlamaConfig(**LLAMA_LIKE, num_key_value_heads=2),
        # Fewer K/V heads than ranks: each rank keeps a replica of the single K/V head.
        "llama-kv1": lambda: t.LlamaConfig(**LLAMA_LIKE, num_key_value_heads=1),
        "mistral": lambda: t.MistralConfig(**LLAMA_LIKE, num_key_value_heads=2),
        "qwen2": lambda: t.Qwen2Config(**LLAMA_LIKE, num_key_value_heads=2),  # q/k/v biases
        # Experts split by intermediate features; the router is replicated.
        "mixtral": lambda: t.MixtralConfig(
            **LLAMA_LIKE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        ),
        # Plus a dense layer (0) and a sigmoid-gated shared expert (its MLP split as a dense one).
        "qwen2-moe": lambda: t.Qwen2MoeConfig(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[0],
        ),  # fmt: skip
        # fused q/k/v checkpoints split at load, then by heads: GPT-2 (Conv1D), Pythia (per head)
        # (initializer_range as LLAMA_LIKE's: at GPT-2's 0.02 the tokens barely depend on
        # attention and MLP weights, so a mis-sliced layer could go unnoticed)
        "gpt2": lambda: t.GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_head=4,
            n_layer=2,
            n_positions=256,
            initializer_range=0.2,
        ),  # fmt: skip
        "gpt-neox": lambda: t.GPTNeoXConfig(**LLAMA_LIKE, rotary_pct=0.25),
        # OPT-350m's layout: post-LN, 32-wide embeddings projected in and out (replicated).
        "opt": lambda: t.OPTConfig(
            **COMMON,
            ffn_dim=128,
            num_hidden_layers=2,
            init_std=0.2,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
        ),
    }
    return configs[kind]()


def save_model(kind: str, path, vocab_size: int | None = None) -> str:
    """Save a tiny random model; biases and norms get noise too, so slicing mistakes show."""
    config = hf_config(kind)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


def run(llm: LLM, n: int = 10, **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread here: the reference runs then share the cores with the 2-rank ones
    without oversubscription (an engine's rank 0 does the same on the CPU, see launch.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_workers_left():
    """Whatever a test does (or fails to do), no worker outlives it."""
    yield
    shutdown_all()
    assert not multiprocessing.active_children()


def _device_bytes(runner) -> tuple[int, int]:
    """(parameter bytes, KV pool bytes) of one rank's runner (a collective_rpc function)."""
    params = sum(p.untyped_storage().nbytes() for p in runner.model.parameters())
    pools = sum(t.untyped_storage().nbytes() for pair in runner.kv_caches for t in pair)
    return params, pools


def check_sleep_mode_on_every_rank(llm: LLM, path: str, expected: list[list[int]]) -> None:
    """collective_rpc answers from both ranks (an error on rank 1 too, leaving the world
    usable); a level-2 sleep frees both ranks' weights and KV; after waking and loading the
    checkpoint again the engine generates what it did before."""
    awake = llm.collective_rpc(_device_bytes)
    assert len(awake) == 2 and all(params > 0 and pools > 0 for params, pools in awake)
    with pytest.raises(ValueError, match="no public method 'nope'"):
        llm.collective_rpc("nope")
    llm.sleep(level=2)
    assert llm.collective_rpc(_device_bytes) == [(0, 0), (0, 0)]
    llm.wake_up(tags=["weights"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    llm.load_weights(hf.state_dict().items())
    llm.wake_up(tags=["kv_cache"])
    assert llm.collective_rpc(_device_bytes) == awake
    assert run(llm, 12) == expected


def assert_stopped(processes) -> None:
    assert processes, "a 2-rank engine spawns one worker"
    assert not any(p.is_alive() for p in processes)
    assert not multiprocessing.active_children()


# ---- end to end: 2 ranks vs 1 process ---------------------------------------------------------
def test_llama_gqa_with_swapping_and_chunked_prefill(tmp_path):
    # 2 K/V heads over 2 ranks (one each); a small pool forces swap preemption, and chunked
    # prefill mixes decodes with prompt chunks, so block moves and mixed batches go to rank 1.
    path = save_model("llama", tmp_path)
    # (prefix caching with a CPU tier: the second run's prompts come back from it)
    settings = dict(
        block_size=4, num_gpu_blocks_override=16, max_model_len=64, preemption_mode="swap",
        swap_space=0.01, enable_chunked_prefill=True, max_num_batched_tokens=12,
        enable_prefix_caching=True, kv_offloading_size=0.001,
    )  # fmt: skip
    single = LLM(path, **settings)
    expected = run(single, 12)
    assert single.llm_engine.scheduler.num_preemptions_total > 0
    with LLM(path, tensor_parallel_size=2, enable_sleep_mode=True, **settings) as llm:
        processes = llm.llm_engine.parallel.processes
        assert run(llm, 12) == expected
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
        assert run(llm, 12) == expected and llm.llm_engine.scheduler.kv.offload.num_loaded > 0
        k_cache = llm.llm_engine.runner.kv_caches[0][0]
        assert k_cache.shape[2] == 1  # rank 0 keeps its own K/V head only
        # logprobs come from rank 0's gathered full-vocabulary logits
        # (and so do prompt logprobs, whose extra rows every rank computes alike)
        sp = SamplingParams(max_tokens=3, logprobs=3, prompt_logprobs=2)
        lp_single = single.generate(PROMPTS[0], sp)
        lp_tp = llm.generate(PROMPTS[0], sp)
        check_sleep_mode_on_every_rank(llm, path, run(single, 12))
    assert_stopped(processes)
    pairs = list(zip(lp_single[0].outputs[0].logprobs, lp_tp[0].outputs[0].logprobs))
    pairs += list(zip(lp_single[0].prompt_logprobs[1:], lp_tp[0].prompt_logprobs[1:]))
    assert len(pairs) == 3 + len(PROMPTS[0]) - 1
    for a, b in pairs:
        assert a.keys() == b.keys()
        assert all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)


@pytest.mark.parametrize(
    "kind", ["llama-kv1", "mistral", "qwen2", "mixtral", "qwen2-moe", "gpt2", "gpt-neox"]
)
def test_llama_family_matches_single_process(tmp_path, kind):
    path = save_model(kind, tmp_path)
    single = LLM(path, block_size=8, cpu_kv_cache_gib=0.01)
    expected = run(single)
    llm = LLM(path, block_size=8, cpu_kv_cache_gib=0.01, tensor_parallel_size=2)
    processes = llm.llm_engine.parallel.processes
    assert run(llm) == expected
    if kind == "gpt2":  # new weights (fused c_attn, split then sharded) reach both ranks
        gen = torch.Generator().manual_seed(3)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path)
        new = [(n, p.detach() + 0.3 * torch.randn(p.shape, generator=gen))
               for n, p in hf.named_parameters() if ".h.1." in n]  # fmt: skip
        single.load_weights(new)
        llm.load_weights(new)
        updated = run(single)
        assert updated != expected and run(llm) == updated
    if kind == "llama-kv1":
        assert llm.llm_engine.runner.kv_caches[0][0].shape[2] == 1  # a replica of the one head
        llm.shutdown()
    else:
        del llm  # no explicit shutdown: garbage collection stops the worker
        gc.collect()
    assert_stopped(processes)


# ---- any vocabulary size: padded vocabulary shards -------------------------------------------
# Odd sizes, as real checkpoints have (GPT-2's 50,257); at 4 ranks GPT-2's 97 tokens leave
# ranks 2 and 3 holding padding rows only.
ODD_VOCAB = {"llama": 997, "gpt2": 97, "gpt-neox": 331, "opt": 253}


def outputs_of(llm: LLM, vocab: int) -> tuple[list, list, list]:
    """(greedy tokens, seeded sampled tokens, greedy logprobs and prompt logprobs)."""
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, [vocab - 1, 7, vocab - 2, 3]]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)  # fmt: skip
    sampled = [SamplingParams(temperature=1.0, top_k=vocab, seed=i, max_tokens=8, ignore_eos=True)
               for i in range(len(prompts))]  # fmt: skip
    g = llm.generate(prompts, greedy, use_tqdm=False)
    s = llm.generate(prompts, sampled, use_tqdm=False)
    logprobs = [(o.outputs[0].logprobs, o.prompt_logprobs[1:]) for o in g]
    return [o.outputs[0].token_ids for o in g], [o.outputs[0].token_ids for o in s], logprobs


def assert_same_outputs(got: tuple, expected: tuple) -> None:
    """Equal tokens; logprob entries with the same token ids, ranks and values (1e-4)."""
    assert got[:2] == expected[:2]
    for (out_a, prompt_a), (out_b, prompt_b) in zip(got[2], expected[2]):
        for a, b in zip(out_a + prompt_a, out_b + prompt_b):
            assert a.keys() == b.keys()
            assert all(a[t].rank == b[t].rank for t in a)
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", list(ODD_VOCAB))
def test_odd_vocabularies_match_single_process(tmp_path, kind, ranks):
    """Each rank holds a padded slice of the vocabulary (a multiple of 64 rows); the padding
    is never looked up, rank 0 cuts its logits off, and the engine's vocabulary checks use the
    real size: the same greedy and seeded tokens and logprobs as one process."""
    vocab = ODD_VOCAB[kind]
    path = save_model(kind, tmp_path, vocab_size=vocab)
    expected = outputs_of(LLM(path, block_size=8, cpu_kv_cache_gib=0.01), vocab)
    with LLM(path, block_size=8, cpu_kv_cache_gib=0.01, tensor_parallel_size=ranks) as llm:
        assert_same_outputs(outputs_of(llm, vocab), expected)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate({"prompt_token_ids": [1, vocab]})  # a padding row's id
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(PROMPTS[0], SamplingParams(allowed_token_ids=[vocab]))
        rows = llm.collective_rpc(_vocab_rows)
    padded = -(-vocab // (VOCAB_PADDING * ranks)) * VOCAB_PADDING * ranks
    assert rows == [padded // ranks] * ranks


def _vocab_rows(runner) -> int:
    """Rows of one rank's token embedding (collective_rpc)."""
    return runner.model.get_input_embeddings().weight.shape[0]


def _write_adapters(base: str, root: Path, targets: dict[str, list[str]]) -> list[LoRARequest]:
    """PEFT adapters with random A and B (tests/test_lora.py's writer), as LoRARequests."""
    from test_lora import write_adapter

    requests = []
    for i, (name, modules) in enumerate(targets.items()):
        write_adapter(base, root / name, modules, r=4, alpha=8, seed=i)
        requests.append(LoRARequest(name, i + 1, str(root / name)))
    return requests


LORA_TARGETS = {
    # Llama: column-parallel q/v/gate/up (B's rows split) and row-parallel o/down (A's columns)
    "llama": {"a": ["q_proj", "v_proj", "down_proj"], "b": ["k_proj", "o_proj", "up_proj"]},
    # GPT-2: the fused c_attn adapter split into q/k/v first, then by heads
    "gpt2": {"a": ["c_attn", "c_proj"], "b": ["c_attn", "c_fc"]},
}


@pytest.mark.parametrize("kind, ranks", [("llama", 2), ("gpt2", 4)])
def test_lora_adapters_match_single_process(tmp_path, kind, ranks):
    """Multi-LoRA under tensor parallelism: each rank keeps B's rows of its column-parallel
    slices and A's columns of its row-parallel ones (whose partial deltas join the partial
    products before the all-reduce); adapters and the base model in one batch give one
    process's tokens, and an adapter removed on rank 0 is gone on every rank."""
    vocab = ODD_VOCAB[kind]
    path = save_model(kind, tmp_path / "base", vocab_size=vocab)
    requests = _write_adapters(path, tmp_path, LORA_TARGETS[kind])
    per_prompt = [requests[0], requests[1], None, requests[0]]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    settings = dict(block_size=8, cpu_kv_cache_gib=0.01, enable_lora=True, max_loras=2)

    def generate(llm):
        outs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]

    single = LLM(path, **settings)
    expected = generate(single)
    base = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    assert expected[0][0] != base[0] and expected[0][1] != base[1]  # the adapters matter
    with LLM(path, tensor_parallel_size=ranks, **settings) as llm:
        tokens, logprobs = generate(llm)
        assert tokens == expected[0]
        for a, b in zip(sum(logprobs, []), sum(expected[1], [])):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
        assert llm.llm_engine.remove_lora(1)
        assert llm.collective_rpc(_registered_loras) == [[2]] * ranks


def _registered_loras(runner) -> list[int]:
    return runner.lora.list()


def test_lora_on_quantized_weights_is_refused_before_spawning(llama_dir):
    with pytest.raises(ValueError, match="LoRA adapters on quantized weights"):
        LLM(llama_dir, tensor_parallel_size=2, enable_lora=True, quantization="int8")
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_model_drafters_with_an_odd_vocabulary(tmp_path, method):
    """A draft model (here the target itself, so drafts are accepted) or an EAGLE head beside
    a 2-rank target of 997 tokens: EAGLE's gathered embedding and head drop the padding rows;
    the same tokens, logprobs and draft/acceptance counts as one process."""
    from paged_llm.models.eagle import random_eagle_head

    vocab = ODD_VOCAB["llama"]
    target = save_model("llama", tmp_path / "target", vocab_size=vocab)
    draft = target if method == "draft_model" else random_eagle_head(target, tmp_path / "h", 3)
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(draft)}
    settings = dict(speculative_config=spec, block_size=8, cpu_kv_cache_gib=0.01)
    single = LLM(target, **settings)
    expected = outputs_of(single, vocab)
    with LLM(target, tensor_parallel_size=2, **settings) as llm:
        assert_same_outputs(outputs_of(llm, vocab), expected)
        stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats == single.llm_engine.spec_stats
    if method == "draft_model":
        assert stats.num_accepted_tokens > 0


def test_quantized_kv_cache_with_swapping_matches_single_process(tmp_path):
    """An int8 KV cache: each rank quantizes its own K/V heads (one scale per token and head,
    as in one process; with one K/V head both ranks hold a replica), and the scales move with
    their blocks when a small pool swaps."""
    path = save_model("llama-kv1", tmp_path)
    settings = dict(block_size=4, num_gpu_blocks_override=16, max_model_len=64,
                    preemption_mode="swap", swap_space=0.01, kv_cache_dtype="int8")  # fmt: skip
    single = LLM(path, **settings)
    expected = run(single, 12)
    assert single.llm_engine.scheduler.num_preemptions_total > 0
    with LLM(path, tensor_parallel_size=2, **settings) as llm:
        assert run(llm, 12) == expected
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
        assert llm.llm_engine.runner.kv_caches[0][0].dtype == torch.int8


def _dequantized_linears(runner) -> dict[str, tuple[str, torch.Tensor]]:
    """One rank's quantized block linears, dequantized: name -> ("column" | "row", [N, K])."""
    from paged_llm.quant.layers import QuantLinear
    from paged_llm.quant.parallel import RowParallelQuantLinear

    out = {}
    for name, module in runner.model.named_modules():
        if isinstance(module, RowParallelQuantLinear):
            out[name] = ("row", module.quant.dequantize())
        elif isinstance(module, QuantLinear) and not name.endswith(".quant"):
            out[name] = ("column", module.dequantize())
    return out


@pytest.mark.parametrize("method", ["int8", "int4_rtn"])
def test_weight_quantization_of_each_ranks_shard(tmp_path, method):
    """Each rank quantizes its shard: the 2-rank engine generates what one process generates
    with the weights the ranks hold (their dequantized shards put together). int4's groups of
    32 inputs lie inside each rank's slice, so int4 also equals one process's int4 exactly."""
    path = save_model("llama", tmp_path)
    spec = INT4_32 if method == "int4_rtn" else method
    with LLM(path, block_size=8, cpu_kv_cache_gib=0.01, tensor_parallel_size=2,
             quantization=spec) as llm:  # fmt: skip
        got = run(llm)
        ranks = llm.collective_rpc(_dequantized_linears)
    assert len(ranks[0]) == 2 * 7  # q, k, v, o, gate, up, down of both layers
    one = LLM(path, block_size=8, cpu_kv_cache_gib=0.01, quantization=spec)
    weights = []
    for name, (kind, _) in ranks[0].items():
        parts = [rank[name][1] for rank in ranks]
        full = torch.cat(parts, dim=0 if kind == "column" else 1)
        if kind == "column" or method == "int4_rtn":  # whole rows / groups: as one process
            assert torch.equal(full, one.llm_engine.model.get_submodule(name).dequantize()), name
        weights.append((f"{name}.weight", full))
    single = LLM(path, block_size=8, cpu_kv_cache_gib=0.01)
    single.load_weights(weights)
    assert got == run(single)
    if method == "int4_rtn":
        assert got == run(one)


@pytest.mark.parametrize(
    "method, drafter", [("draft_model", "test-draft"), ("eagle", "test-eagle")]
)
def test_model_drafters_match_single_process(method, drafter):
    """A draft model or an EAGLE head (unsplit, on every rank, drafting on rank 0; EAGLE with
    the target's embeddings and LM head read whole) beside a 2-rank target: the same greedy
    tokens, drafts and acceptances as one process, sampling with a seed too."""
    from paged_llm.models import trained

    target = str(trained.trained_model_dir("test-target"))
    spec = {"method": method, "num_speculative_tokens": 3,
            "model": str(trained.trained_model_dir(drafter))}  # fmt: skip
    settings = dict(speculative_config=spec, cpu_kv_cache_gib=0.01, max_model_len=128)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)

    def both(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampled, use_tqdm=False)
        return run(llm, 16), [o.outputs[0].token_ids for o in outs]

    single = LLM(target, **settings)
    expected = both(single)
    with LLM(target, tensor_parallel_size=2, **settings) as llm:
        assert both(llm) == expected
        stats = llm.llm_engine.spec_stats
    assert stats.num_accepted_tokens > 0
    assert stats == single.llm_engine.spec_stats


@pytest.mark.parametrize("kind, fmt", [("gpt2", "gptq"), ("llama", "awq")])
def test_prequantized_checkpoints_split_across_ranks(tmp_path, kind, fmt):
    """A GPTQ / AWQ checkpoint: each rank takes its output columns (column-parallel; GPT-2's
    fused c_attn split first) or its whole groups of input rows (row-parallel) of the packed
    tensors, and generates what one process generates from the same directory."""
    from paged_llm.models.loader import load_model
    from paged_llm.quant import apply_quantization
    from paged_llm.quant.checkpoint import save_quantized

    model, _ = load_model(save_model(kind, tmp_path / "float"), torch.float32)
    out = save_quantized(apply_quantization(model, INT4_32), tmp_path / fmt, fmt)
    expected = run(LLM(str(out), block_size=8, cpu_kv_cache_gib=0.01))
    with LLM(str(out), block_size=8, cpu_kv_cache_gib=0.01, tensor_parallel_size=2) as llm:
        assert run(llm) == expected


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_prequantized_experts_split_across_ranks(tmp_path, expert_parallel):
    """A GPTQ Mixtral (one int4 layer per expert and projection): each rank stacks its slice
    of every expert (gate/up rows, down's whole groups of inputs) or, with expert parallelism,
    its own experts whole; the same tokens as one process loading the directory."""
    from paged_llm.models.loader import load_model
    from paged_llm.quant import apply_quantization
    from paged_llm.quant.checkpoint import save_quantized

    model, _ = load_model(save_model("mixtral", tmp_path / "float"), torch.float32)
    out = save_quantized(apply_quantization(model, INT4_32), tmp_path / "gptq", "gptq")
    expected = run(LLM(str(out), block_size=8, cpu_kv_cache_gib=0.01))
    with LLM(str(out), block_size=8, cpu_kv_cache_gib=0.01, tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel) as llm:  # fmt: skip
        assert run(llm) == expected
        shapes = llm.collective_rpc(_gate_up_shapes)
    assert shapes == [[(2, 256, 32) if expert_parallel else (4, 128, 32)]] * 2


def _gate_up_shapes(runner) -> list[tuple[int, ...]]:
    """The distinct shapes of one rank's stacked gate/up expert weights (collective_rpc)."""
    from paged_llm.layers.moe import FusedExperts

    found = {tuple(m.gate_up_proj.shape) for m in runner.model.modules()
             if isinstance(m, FusedExperts)}  # fmt: skip
    return sorted(found)


@pytest.mark.parametrize(
    "kind, quantization", [("mixtral", None), ("qwen2-moe", None), ("mixtral", INT4_32)]
)
def test_expert_parallel_matches_single_process(tmp_path, kind, quantization):
    """enable_expert_parallel: each rank holds 2 of the 4 experts whole (not half of every
    expert's intermediate features), and greedy tokens equal one process's; with int4 experts
    too (whole experts, and attention groups inside each rank's slice, quantize as in one
    process)."""
    path = save_model(kind, tmp_path)
    settings = dict(block_size=8, cpu_kv_cache_gib=0.01, quantization=quantization)
    expected = run(LLM(path, **settings))
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **settings)
    inter = 128 if kind == "mixtral" else 32
    packed = 2 if quantization else 1  # int4 experts: two inputs a byte
    assert llm.collective_rpc(_gate_up_shapes) == [[(2, 2 * inter, 64 // packed)]] * 2
    assert run(llm) == expected
    llm.shutdown()


def _blocks_loaded(runner) -> int:
    return runner.kv_connector.num_loaded


def test_kv_transfer_saves_and_loads_every_ranks_heads(llama_dir, tmp_path):
    """kv_both over 2 ranks: each rank writes the K/V heads it holds, and the second run loads
    them back on both ranks instead of computing them (docs/kv_transfer.md)."""
    store = tmp_path / "kv"
    transfer = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}  # fmt: skip
    expected = run(LLM(llama_dir, block_size=4, cpu_kv_cache_gib=0.01))
    with LLM(llama_dir, block_size=4, cpu_kv_cache_gib=0.01, tensor_parallel_size=2,
             kv_transfer_config=transfer) as llm:  # fmt: skip
        assert run(llm) == expected
        assert run(llm) == expected
        loaded = llm.collective_rpc(_blocks_loaded)
    full_blocks = sum((len(p) - 1) // 4 for p in PROMPTS)
    assert loaded == [full_blocks, full_blocks]
    (root,) = store.iterdir()
    names = [f.name for f in root.iterdir()]
    assert sum(n.endswith(".rank0.safetensors") for n in names) == len(names) // 2


def test_opt_matches_single_process_with_beam_search(tmp_path):
    path = save_model("opt", tmp_path)
    single = LLM(path, block_size=4, cpu_kv_cache_gib=0.01)
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    with LLM(path, block_size=4, cpu_kv_cache_gib=0.01, tensor_parallel_size=2) as llm:
        processes = llm.llm_engine.parallel.processes
        assert run(llm) == run(single)
        tp_beams = llm.beam_search(prompts, beams)  # log-probabilities without sampling
    assert_stopped(processes)
    expected = single.beam_search(prompts, beams)
    for a, b in zip(tp_beams, expected):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


TORCHRUN_SCRIPT = """
import json, sys
from paged_llm import LLM, SamplingParams

prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
llm = LLM(sys.argv[1], block_size=8, cpu_kv_cache_gib=0.01, tensor_parallel_size=2)
# ranks > 0 get here once rank 0 has shut down
if llm.llm_engine.parallel.is_driver:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    llm.shutdown()
else:
    try:
        llm.generate(prompts)
    except ValueError as err:
        print("REFUSED", err, flush=True)
"""


def test_torchrun_world(llama_dir, tmp_path):
    # The processes join the world from torchrun's environment instead of being spawned.
    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(script), llama_dir, json.dumps(PROMPTS)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert json.loads(tokens[0].removeprefix("TOKENS ")) == run(
        LLM(llama_dir, block_size=8, cpu_kv_cache_gib=0.01)
    )
    assert "REFUSED" in done.stdout and "submit requests on rank 0" in done.stdout


# ---- errors: raised before any worker starts ---------------------------------------------------
def engine_config(**kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(model="unused", tensor_parallel_size=2, **kwargs)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=96), None),  # fine
        (dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=48), "num_attention_h"),
        (dict(vocab_size=255), None),  # any vocabulary: its shards are padded
        (dict(intermediate_size=129), r"intermediate size .*\(129\)"),
        (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96), "num_key_value"),
    ],
)
def test_shape_errors(overrides, match):
    config = transformers.LlamaConfig(**{**LLAMA_LIKE, "num_key_value_heads": 2, **overrides})
    if match is None:
        check_tensor_parallel(engine_config(device="cpu"), config)
    else:
        with pytest.raises(ValueError, match=match):
            check_tensor_parallel(engine_config(device="cpu"), config)


def test_expert_parallel_errors():
    llama, mixtral = hf_config("llama"), hf_config("mixtral")
    llama.architectures, mixtral.architectures = ["LlamaForCausalLM"], ["MixtralForCausalLM"]
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_tensor_parallel(engine_config(device="cpu", enable_expert_parallel=True), llama)
    mixtral.num_local_experts = 6
    config = EngineConfig.from_kwargs(model="unused", tensor_parallel_size=4, device="cpu",
                                      enable_expert_parallel=True)  # fmt: skip
    with pytest.raises(ValueError, match="6 experts do not split evenly"):
        check_tensor_parallel(config, mixtral)
    mixtral.num_local_experts = 4
    check_tensor_parallel(engine_config(device="cpu", enable_expert_parallel=True), mixtral)


def test_opt_ffn_and_size_errors():
    config = hf_config("opt")
    config.ffn_dim = 129
    with pytest.raises(ValueError, match=r"\(129\)"):
        check_tensor_parallel(engine_config(device="cpu"), config)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel(EngineConfig.from_kwargs(tensor_parallel_size=0), config)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_model("llama", tmp_path_factory.mktemp("tp-llama"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quantization="int4_gptq"), "weight quantization with calibration"),
        (
            dict(speculative_config={"num_speculative_tokens": 2, "_target_": "x.Drafter"}),
            "custom speculative drafter",
        ),
        (dict(tensor_parallel_size=3), "not divisible by tensor_parallel_size=3"),
        (dict(device="cuda:1"), "one per rank"),
    ],
)
def test_unsupported_combinations_raise_before_spawning(llama_dir, kwargs, match):
    kwargs = {"tensor_parallel_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(llama_dir, cpu_kv_cache_gib=0.01, **kwargs)
    assert not multiprocessing.active_children()


# ---- the pieces, in one process -----------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1, 63, 97, 256, 997, 50257])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_vocab_shards_cover_the_vocabulary_once(vocab, size):
    shards = [shard_vocab(vocab, TPGroup(r, size)) for r in range(size)]
    padded = shards[0].padded_vocab_size
    assert padded % (VOCAB_PADDING * size) == 0 and vocab <= padded < vocab + VOCAB_PADDING * size
    assert all(s.size == padded // size and s.start == r * s.size for r, s in enumerate(shards))
    real = [i for s in shards for i in range(s.start, s.start + s.num_real)]
    assert real == list(range(vocab))  # each real row on exactly one rank, in order
    full = torch.arange(vocab, dtype=torch.float32).unsqueeze(1).expand(vocab, 3)
    cut = torch.cat([s.cut(full) for s in shards])  # what the ranks load, end to end
    assert torch.equal(cut[:vocab], full) and not cut[vocab:].any()


def test_vocab_parallel_pieces_pad_and_cut():
    """Rank 1 of 2 of a 97-token embedding / head: rows 64..96 of the checkpoint then zero
    padding, and the head's slice scores the real ones."""
    torch.manual_seed(0)
    full = torch.randn(97, 8)
    with building_for(TPGroup(1, 2)):
        embed, head = vocab_embedding(97, 8), lm_head(8, 97)
    for layer in (embed, head):
        layer.weight.data.copy_(layer.shard_weight("weight", full))
        assert layer.weight.shape == (64, 8)
        assert torch.equal(layer.weight[:33], full[64:]) and not layer.weight[33:].any()
    x = torch.randn(2, 8)
    assert torch.allclose(nn.functional.linear(x, head.weight)[:, :33], x @ full[64:].T)


def test_factories_are_plain_torch_modules_at_world_size_one():
    # Quantization swaps modules whose type is exactly nn.Linear: keep them so without TP.
    assert type(column_linear(4, 8, True)) is nn.Linear
    assert type(row_linear(8, 4, False)) is nn.Linear
    assert type(vocab_embedding(16, 4)) is nn.Embedding
    assert type(lm_head(4, 16)) is nn.Linear
    with building_for(TPGroup(1, 2)):
        assert isinstance(column_linear(4, 8, True), ColumnParallelLinear)
        assert isinstance(row_linear(8, 4, False), RowParallelLinear)
        assert isinstance(vocab_embedding(16, 4), VocabParallelEmbedding)
        assert isinstance(lm_head(4, 16), ParallelLMHead)
    assert type(column_linear(4, 8, True)) is nn.Linear  # the context is restored


@pytest.mark.parametrize(
    "heads, kv, size, expected",
    [
        (8, 8, 2, [(4, 4, 0), (4, 4, 4)]),  # multi-head: split alike
        (8, 2, 2, [(4, 1, 0), (4, 1, 1)]),  # GQA: one K/V head per rank
        (8, 2, 4, [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]),  # replicated pairs
        (4, 1, 2, [(2, 1, 0), (2, 1, 0)]),  # one K/V head on every rank
    ],
)
def test_head_shards(heads, kv, size, expected):
    shards = [shard_heads(heads, kv, TPGroup(r, size)) for r in range(size)]
    assert [(s.num_heads, s.num_kv_heads, s.first_kv_head) for s in shards] == expected
    assert kv_heads_per_rank(kv, size) == expected[0][1]
    for r, s in enumerate(shards):  # every query head of a rank reads its rank's K/V head
        group = heads // kv
        q_heads = range(r * s.num_heads, (r + 1) * s.num_heads)
        kv_heads = range(s.first_kv_head, s.first_kv_head + s.num_kv_heads)
        assert {q // group for q in q_heads} == set(kv_heads)


def test_checkpoint_slices_and_math_match_the_full_layers():
    # Rank 1 of 2 of each layer, loaded from full tensors: its slice of the full layer's math.
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    full_col, full_row = nn.Linear(8, 6), nn.Linear(6, 8)
    with building_for(TPGroup(1, 2)):
        col = column_linear(8, 6, True)
        col_kv = column_linear(8, 6, True, rows=(0, 2))  # a replicated K/V head: rows 0-1
        row = row_linear(6, 8, True)
    model = nn.ModuleDict({"col": col, "col_kv": col_kv, "row": row})
    sources = {"col": full_col, "col_kv": full_col, "row": full_row}
    full = {f"{m}.{p}": getattr(src, p) for m, src in sources.items() for p in ("weight", "bias")}
    for name, tensor in shard_checkpoint(model, full.items()):
        model.get_parameter(name).data.copy_(tensor)
    with torch.no_grad():
        assert torch.allclose(col(x), full_col(x)[:, 3:])
        assert torch.allclose(col_kv(x), full_col(x)[:, :2])
        assert torch.equal(row.weight, full_row.weight[:, 3:])
        assert torch.equal(row.bias, full_row.bias)  # added once, after the all-reduce
