"""Pooling models (vLLM's runner="pooling": LLM.embed / LLM.encode, /v1/embeddings): every
pooling type against transformers' own hidden states, across chunked prefill, preemption and
the prefix cache; sentence-transformers configs; PoolingParams; what is refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_batch_fuzz import engine_configs

from paged_llm import LLM, LLMEngine, PoolingParams, SamplingParams
from paged_llm.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from paged_llm.pooling.config import PoolerConfig, resolve_pooler_config
from paged_llm.pooling.pooler import Pooler

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 17, 33, 2] * 3, [7, 8, 9], list(range(3, 40)), [11] * 9, [4]]
SMALL = dict(block_size=4, cpu_kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(directory, transformers model) of a tiny Qwen3 (the Qwen3-Embedding architecture)."""
    path = tmp_path_factory.mktemp("qwen3-embed")
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(str(path))
    return str(path), model


@torch.no_grad()
def hidden_states(hf_model, prompt) -> torch.Tensor:  # [L, H]
    """transformers' final hidden states (after the final norm) of one prompt."""
    return hf_model.model(torch.tensor([prompt])).last_hidden_state[0].float()


def reference(hf_model, prompt, pooling_type, normalize) -> torch.Tensor:
    h = hidden_states(hf_model, prompt)
    pooled = {"LAST": h[-1], "CLS": h[0], "MEAN": h.mean(0), "ALL": h}[pooling_type]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS", "ALL"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_types_match_transformers(qwen3, pooling_type, normalize):
    """Ragged prompts split into chunks of at most 8 tokens (chunked prefill)."""
    path, hf = qwen3
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": pooling_type,
              "normalize": normalize}, enable_chunked_prefill=True, max_num_batched_tokens=8,
              **SMALL)  # fmt: skip
    outs = llm.encode(token_prompts(PROMPTS), use_tqdm=False)
    assert all(isinstance(o, PoolingRequestOutput) and o.finished for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        expected = reference(hf, prompt, pooling_type, normalize)
        torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=1e-5)
        assert out.prompt_token_ids == prompt
    assert llm.llm_engine.kv_usage() == 0


def test_embed_returns_lists_of_floats_and_text_prompts_work(qwen3):
    path, hf = qwen3
    llm = LLM(path, task="embed", **SMALL)  # vLLM's older spelling of runner="pooling"
    outs = llm.embed([{"prompt_token_ids": PROMPTS[0]}, PROMPTS[1]], use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    assert outs[0].outputs.hidden_size == 64 and isinstance(outs[0].outputs.embedding[0], float)
    for prompt, out in zip(PROMPTS[:2], outs):
        expected = reference(hf, prompt, "LAST", True)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5,
                                   rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS", "ALL"])
def test_a_prompt_that_runs_again_restarts_its_fold(pooling_type):
    """A prompt recomputed after preemption arrives again from position 0: the pooler starts
    over instead of counting its first chunks twice. (The engine's scheduler gives running
    prefills the token budget first, so prompt-only batches do not preempt; this is the
    pooler's contract for when they do.)"""
    pooler = Pooler(PoolerConfig(pooling_type, normalize=False))
    hidden = torch.randn(10, 4)
    spans = lambda start, n: [("r", 0, start, n, 10)]  # noqa: E731
    params = {"r": PoolingParams()}
    assert pooler.update(hidden[:4], spans(0, 4), params) == {}  # chunk 1 ...
    assert pooler.update(hidden[4:7], spans(4, 3), params) == {}  # chunk 2, then preempted
    assert pooler.update(hidden[:5], spans(0, 5), params) == {}  # again from the start
    done = pooler.update(hidden[5:], spans(5, 5), params)
    expected = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(0), "ALL": hidden}
    torch.testing.assert_close(done["r"], expected[pooling_type])
    assert not pooler._states  # finished requests leave nothing behind


def test_prefix_cache_serves_last_pooling_but_not_mean(qwen3):
    path, hf = qwen3
    prompt = list(range(3, 30))
    for pooling_type, may_hit in (("LAST", True), ("MEAN", False)):
        llm = LLM(path, runner="pooling", pooler_config={"pooling_type": pooling_type},
                  enable_prefix_caching=True, **SMALL)  # fmt: skip
        first, second = (llm.encode(token_prompts([prompt]), use_tqdm=False)[0] for _ in "ab")
        assert (second.num_cached_tokens > 0) is may_hit
        for out in (first, second):
            expected = reference(hf, prompt, pooling_type, True)
            torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=1e-5)


def test_step_level_engine_takes_pooling_params(qwen3):
    path, hf = qwen3
    engine = LLMEngine.from_engine_args(model=path, runner="pooling", **SMALL)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[2]}, PoolingParams(normalize=False))
    outs = list(engine.iter_outputs())
    assert [o.request_id for o in outs] == ["a"] and outs[0].finished
    torch.testing.assert_close(outs[0].outputs.data, hidden_states(hf, PROMPTS[2])[-1],
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_a_prompt_may_fill_max_model_len(qwen3):
    path, _ = qwen3
    llm = LLM(path, runner="pooling", max_model_len=16, **SMALL)
    assert len(llm.embed([list(range(3, 19))], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="17 tokens; max_model_len is 16$"):
        llm.embed([list(range(3, 20))], use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_end(qwen3):
    path, hf = qwen3
    llm = LLM(path, runner="pooling", **SMALL)
    out = llm.embed([PROMPTS[2]], use_tqdm=False, truncate_prompt_tokens=5)[0]
    assert out.prompt_token_ids == PROMPTS[2][-5:]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               reference(hf, PROMPTS[2][-5:], "LAST", True), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


def test_matryoshka_dimensions(qwen3, tmp_path):
    path, hf = qwen3
    with pytest.raises(ValueError, match="only for Matryoshka"):
        LLM(path, runner="pooling", **SMALL).embed([[5, 6]], PoolingParams(dimensions=8))
    config = transformers.AutoConfig.from_pretrained(path)
    config.is_matryoshka = True
    hf.save_pretrained(str(tmp_path))
    config.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), runner="pooling", **SMALL)
    out = llm.embed([PROMPTS[0]], PoolingParams(dimensions=8), use_tqdm=False)[0]
    expected = F.normalize(hidden_states(hf, PROMPTS[0])[-1][:8], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="exceeds the hidden size 64"):
        llm.embed([[5, 6]], PoolingParams(dimensions=65))


def write_sentence_transformers(model_dir, mode_flag, normalize=True, extra_modules=()):
    """modules.json and a Pooling module config, as sentence-transformers saves them."""
    st = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"})
    modules += [{"idx": 9, "name": "9", "path": "9_x", "type": st + m} for m in extra_modules]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, mode_flag: True})
    )


def test_sentence_transformers_files_choose_the_pooling(tmp_path):
    write_sentence_transformers(tmp_path, "pooling_mode_mean_tokens", normalize=False)
    assert resolve_pooler_config(None, tmp_path) == PoolerConfig("MEAN", False)
    # what the caller asks for wins, field by field
    assert resolve_pooler_config({"normalize": True}, tmp_path) == PoolerConfig("MEAN", True)
    write_sentence_transformers(tmp_path, "pooling_mode_cls_token")
    assert resolve_pooler_config(None, tmp_path) == PoolerConfig("CLS", True)
    assert resolve_pooler_config(None, None) == PoolerConfig("LAST", True)  # no files: default
    write_sentence_transformers(tmp_path, "pooling_mode_max_tokens")
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        resolve_pooler_config(None, tmp_path)
    write_sentence_transformers(tmp_path, "pooling_mode_lasttoken", extra_modules=["Dense"])
    with pytest.raises(ValueError, match="does not apply.*Dense"):
        resolve_pooler_config(None, tmp_path)


def test_a_sentence_transformers_checkpoint_pools_as_it_says(qwen3, tmp_path):
    _, hf = qwen3
    hf.save_pretrained(str(tmp_path))
    write_sentence_transformers(tmp_path, "pooling_mode_mean_tokens")
    out = LLM(str(tmp_path), runner="pooling", **SMALL).embed([PROMPTS[2]], use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               reference(hf, PROMPTS[2], "MEAN", True), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


def test_what_is_refused(qwen3):
    path, _ = qwen3
    generator = LLM(path, **SMALL)
    with pytest.raises(ValueError, match="start it with runner='pooling'"):
        generator.embed([[5, 6]])
    pooling = LLM(path, runner="pooling", **SMALL)
    with pytest.raises(ValueError, match="expected PoolingParams, got SamplingParams"):
        pooling.generate([[5, 6]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="one vector per prompt"):
        LLM(path, runner="pooling", pooler_config={"pooling_type": "ALL"}, **SMALL).embed([[5]])
    with pytest.raises(ValueError, match="speculative decoding does not apply"):
        LLM(path, runner="pooling", speculative_config={"method": "ngram",
            "num_speculative_tokens": 2}, **SMALL)  # fmt: skip
    with pytest.raises(ValueError, match="unknown pooling_type 'MAX'"):
        LLM(path, runner="pooling", pooler_config={"pooling_type": "max"}, **SMALL)
    with pytest.raises(ValueError, match="unknown pooler_config field"):
        LLM(path, runner="pooling", pooler_config={"pooling": "LAST"}, **SMALL)
    with pytest.raises(ValueError, match="unknown runner"):
        LLM(path, runner="embed", **SMALL)
    with pytest.raises(ValueError, match="unknown task"):
        LLM(path, task="transcribe", **SMALL)
    with pytest.raises(ValueError, match=r"prompt 1: .*truncate_prompt_tokens"):
        pooling.embed([[5], [6]], [PoolingParams(), PoolingParams(truncate_prompt_tokens=0)])
    assert not pooling.llm_engine.has_unfinished_requests()  # nothing was queued


FUZZ_PROMPTS = [list(range(3, 3 + n)) for n in (1, 5, 17, 40)]


@pytest.fixture(scope="module")
def tiny_reference():
    """prompt index -> {pooling type: the output of that prompt alone on a plain engine}."""
    engines = {t: LLM("tiny", runner="pooling", pooler_config={"pooling_type": t},
                      max_model_len=96) for t in ("LAST", "MEAN", "CLS")}  # fmt: skip
    return [{t: llm.encode([p], use_tqdm=False)[0].outputs.data for t, llm in engines.items()}
            for p in FUZZ_PROMPTS]  # fmt: skip


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    cfg=engine_configs(),
    pooling_type=st.sampled_from(["LAST", "MEAN", "CLS"]),
    requests=st.lists(st.integers(0, len(FUZZ_PROMPTS) - 1), min_size=1, max_size=6),
)
def test_pooling_on_random_engines(tiny_reference, cfg, pooling_type, requests):
    """Pooling requests on random engines (small pools that preempt by recompute or swap,
    chunked prefill with any budget, prefix caching, Orca and static policies, any block size,
    quantized KV caches): each output equals the prompt's alone, and no block is left behind."""
    cfg.pop("speculative_config", None)  # refused for pooling (its own test)
    exact = cfg.get("kv_cache_dtype") == "auto" and cfg.get("quantization") is None \
        and cfg.get("dtype") == "float32"  # fmt: skip
    try:
        llm = LLM("tiny", runner="pooling", pooler_config={"pooling_type": pooling_type}, **cfg)
    except ValueError:
        event("engine refused")
        return
    try:
        outs = llm.encode([FUZZ_PROMPTS[i] for i in requests], use_tqdm=False)
    except ValueError as err:  # a prompt longer than this engine's max_model_len or pool
        assert "max_model_len" in str(err) or "blocks" in str(err)
        event("prompt refused")
        return
    event("ran")
    for i, out in zip(requests, outs):
        expected = tiny_reference[i][pooling_type]
        tol = 1e-5 if exact else 0.15  # quantized weights / KV / bf16: close, not equal
        torch.testing.assert_close(out.outputs.data, expected, atol=tol, rtol=0)
    engine = llm.llm_engine
    assert engine.kv_usage() == 0 and engine.scheduler.kv.num_free_blocks() == engine.num_kv_blocks


def test_server_embeddings(qwen3):
    """/v1/embeddings on a --runner pooling server: OpenAI's response shape, float and base64
    encodings equal to LLM.embed, usage counted; completions refused there, embeddings refused
    on a generating server."""
    import base64

    import httpx
    import numpy as np

    from paged_llm.serve.background import ServerThread
    from paged_llm.serve.cli import build, make_parser

    path, _ = qwen3
    common = [path, "--served-model-name", "emb", "--cpu-kv-cache-gib", "0.01",
              "--disable-log-stats", "--block-size", "4"]  # fmt: skip
    offline = LLM(path, runner="pooling", **SMALL).embed(PROMPTS[:3], use_tqdm=False)
    expected = [torch.tensor(o.outputs.embedding) for o in offline]
    with ServerThread(build(make_parser().parse_args([*common, "--runner", "pooling"]))) as srv:
        url = srv.url + "/v1/embeddings"
        r = httpx.post(url, json={"model": "emb", "input": PROMPTS[:3]}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "emb"
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert body["usage"] == {"prompt_tokens": sum(map(len, PROMPTS[:3])),
                                 "total_tokens": sum(map(len, PROMPTS[:3])),
                                 "completion_tokens": 0}  # fmt: skip
        for d, e in zip(body["data"], expected):
            torch.testing.assert_close(torch.tensor(d["embedding"]), e, atol=1e-6, rtol=0)
        r = httpx.post(url, json={"input": PROMPTS[0], "encoding_format": "base64"}, timeout=60)
        raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
        torch.testing.assert_close(torch.from_numpy(raw.copy()), expected[0], atol=1e-6, rtol=0)
        r = httpx.post(url, json={"input": PROMPTS[0], "dimensions": 8}, timeout=60)
        assert r.status_code == 400 and "Matryoshka" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/score", json={"text_1": PROMPTS[0], "text_2": PROMPTS[1:3]},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in r.json()["data"]]
        assert scores == pytest.approx([float(expected[0] @ e) for e in expected[1:3]], abs=1e-5)
        alias = httpx.post(srv.url + "/score", json={"text_1": PROMPTS[0],
                           "text_2": PROMPTS[1:3]}, timeout=60)  # fmt: skip  # vLLM's alias
        assert [d["score"] for d in alias.json()["data"]] == scores
        r = httpx.post(srv.url + "/v1/score", json={"text_1": PROMPTS[:2], "text_2": PROMPTS[:3]},
                       timeout=60)  # fmt: skip
        assert r.status_code == 400 and "same length" in r.json()["error"]["message"]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        e2e = [line for line in metrics.splitlines()
               if line.startswith("vllm:e2e_request_latency_seconds_count")]  # fmt: skip
        assert e2e and float(e2e[0].split()[-1]) >= 4  # pooling requests are timed too
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                       timeout=60)  # fmt: skip
        assert r.status_code == 400 and "expected PoolingParams" in r.json()["error"]["message"]
    with ServerThread(build(make_parser().parse_args(common))) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": [5, 6]}, timeout=60)
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


def test_lora_adapter_changes_embeddings_as_peft(qwen3, tmp_path):
    """An adapter on a pooling model: the embedding is the PeftModel's last hidden state."""
    from test_lora import write_adapter

    from paged_llm.lora.request import LoRARequest

    path, hf = qwen3
    pm = write_adapter(path, tmp_path / "lora", ["q_proj", "v_proj", "down_proj"], r=4, alpha=8,
                       seed=2)  # fmt: skip
    llm = LLM(path, runner="pooling", enable_lora=True, max_lora_rank=8, **SMALL)
    req = LoRARequest("emb-lora", 1, str(tmp_path / "lora"))
    with_lora, without = (llm.embed([PROMPTS[2]], use_tqdm=False, lora_request=r)[0]
                          for r in (req, None))  # fmt: skip
    with torch.no_grad():
        h = pm.base_model.model.model(torch.tensor([PROMPTS[2]])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(with_lora.outputs.embedding), F.normalize(h, dim=-1),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(without.outputs.embedding),
        reference(hf, PROMPTS[2], "LAST", True),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.distributed
def test_tensor_parallel_pooling_matches_one_process(qwen3):
    path, _ = qwen3
    settings = dict(runner="pooling", pooler_config={"pooling_type": "MEAN"}, **SMALL)
    single = LLM(path, **settings).encode(token_prompts(PROMPTS), use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **settings) as llm:
        split = llm.encode(token_prompts(PROMPTS), use_tqdm=False)
    for a, b in zip(single, split):
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=1e-5, rtol=1e-5)


def test_embed_bench_runs_and_agrees(tmp_path):
    """The benchmark's smallest run: transformers' embeddings equal the engine's."""
    from experiments import embed_bench
    from paper_repro.common import compose

    cfg = compose("embed_bench", ["prompts=5", "mean_len=8", "batch=2", "repeats=1"])
    doc = embed_bench.write(cfg, tmp_path)
    assert json.loads((tmp_path / "embed_bench.json").read_text())["mode"] == "real"
    assert set(doc["systems"]) == {"paged_llm", "hf_padded", "hf_sorted"}
    for s in doc["systems"].values():
        assert s["max_abs_diff_vs_paged_llm"] < 1e-5 and s["prompt_tokens_per_s"] > 0
    assert doc["systems"]["paged_llm"]["computed_tokens"] == doc["prompt_tokens"]


def test_score_is_the_cosine_of_the_embeddings(qwen3):
    path, hf = qwen3
    llm = LLM(path, runner="pooling", pooler_config={"normalize": False}, **SMALL)
    a, b, c = PROMPTS[0], PROMPTS[2], PROMPTS[3]
    one_to_many = llm.score(a, [b, c, a], use_tqdm=False)
    pairwise = llm.score([a, b], [c, c], use_tqdm=False)
    cos = lambda x, y: float(F.cosine_similarity(hidden_states(hf, x)[-1],  # noqa: E731
                                                 hidden_states(hf, y)[-1], dim=0))  # fmt: skip
    assert [o.outputs.score for o in one_to_many] == pytest.approx(
        [cos(a, b), cos(a, c), 1.0], abs=1e-5
    )
    assert [o.outputs.score for o in pairwise] == pytest.approx([cos(a, c), cos(b, c)], abs=1e-5)
    assert one_to_many[0].prompt_token_ids == a + b
    with pytest.raises(ValueError, match="same length"):
        llm.score([a, b], [a, b, c])
