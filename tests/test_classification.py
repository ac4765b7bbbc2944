"""Sequence classification models (HF ``*ForSequenceClassification``) as pooling models:
``LLM.classify`` against transformers' own classifiers, cross-encoder ``LLM.score``, the
server's /classify, /score and /rerank, and what is refused."""

from __future__ import annotations

import pytest
import torch

from paged_llm import LLM, ClassificationRequestOutput, PoolingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 17, 33, 2] * 3, [7, 8, 9], list(range(3, 40)), [11] * 9, [4]]
SMALL = dict(block_size=4, cpu_kv_cache_gib=0.01)
COMMON = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
              initializer_range=0.2)  # fmt: skip
LLAMA_LIKE = dict(COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2)


def configs():
    t = transformers
    return {
        "llama-3-labels": t.LlamaConfig(**LLAMA_LIKE, vocab_size=256, num_labels=3),
        "qwen2-reward": t.Qwen2Config(**LLAMA_LIKE, vocab_size=256, num_labels=1),
        "qwen3-moe-2-labels": t.Qwen3MoeConfig(
            **LLAMA_LIKE,
            vocab_size=256,
            num_labels=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),  # fmt: skip
        "opt-projected": t.OPTConfig(
            **{k: v for k, v in COMMON.items() if k != "initializer_range"},
            vocab_size=256,
            ffn_dim=96,
            num_hidden_layers=2,
            word_embed_proj_dim=32,
            num_labels=2,
            init_std=0.2,
        ),  # fmt: skip
        "gpt2-2-labels": t.GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_head=4,
            n_layer=2,
            n_positions=128,
            num_labels=2,
            initializer_range=0.2,
        ),
        "pythia-reward": t.GPTNeoXConfig(  # multi-head: no num_key_value_heads
            **COMMON,
            intermediate_size=96,
            num_hidden_layers=2,
            vocab_size=256,
            num_labels=1,
            rotary_pct=0.25,
        ),  # fmt: skip
        "multi-label": t.LlamaConfig(
            **LLAMA_LIKE, vocab_size=256, num_labels=4, problem_type="multi_label_classification"
        ),  # fmt: skip
    }


def save_classifier(config, path):
    """A transformers *ForSequenceClassification of ``config``, saved to ``path``."""
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(str(path))
    return model


@torch.no_grad()
def hf_logits(model, prompt) -> torch.Tensor:  # [num_labels]
    """transformers' logits of one unpadded prompt (its last token, as vLLM pools)."""
    return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("case", list(configs()))
def test_classify_matches_transformers(case, tmp_path):
    """Probabilities (softmax, or sigmoid for one label / multi-label) and raw logits of
    ragged prompts, in chunks of at most 8 tokens, equal transformers' classifier."""
    config = configs()[case]
    hf = save_classifier(config, tmp_path)
    llm = LLM(str(tmp_path), runner="pooling", enable_chunked_prefill=True,
              max_num_batched_tokens=8, **SMALL)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.classify(prompts, use_tqdm=False)
    raw = llm.classify(prompts, PoolingParams(activation=False), use_tqdm=False)
    sigmoid = config.num_labels == 1 or case == "multi-label"
    for prompt, out, logits_out in zip(PROMPTS, outs, raw):
        assert isinstance(out, ClassificationRequestOutput)
        assert out.outputs.num_classes == config.num_labels and out.prompt_token_ids == prompt
        logits = hf_logits(hf, prompt)
        expected = logits.sigmoid() if sigmoid else logits.softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(logits_out.outputs.probs), logits, atol=1e-4,
                                   rtol=0)  # fmt: skip
    assert llm.llm_engine.kv_usage() == 0


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """(directory, transformers model) of a one-label Qwen2 classifier with the project's own
    tokenizer: a cross-encoder reranker."""
    from paged_llm.models.tokenizer_builder import build_tokenizer

    path = tmp_path_factory.mktemp("cross-encoder")
    build_tokenizer(path)
    config = transformers.Qwen2Config(**LLAMA_LIKE, vocab_size=2048, num_labels=1)
    return path, save_classifier(config, path)


def test_cross_encoder_scores_pairs_tokenized_together(cross_encoder):
    path, hf = cross_encoder
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), task="score", **SMALL)  # vLLM's task name for cross-encoders
    query, docs = "what is paged attention", ["blocks of the KV cache", "a sorting algorithm"]
    scores = llm.score(query, docs, use_tqdm=False)
    for doc, out in zip(docs, scores):
        ids = tok(text=query, text_pair=doc)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(float(hf_logits(hf, ids)[0].sigmoid()), abs=1e-6)
    by_ids = llm.score({"prompt_token_ids": [5, 6, 7]}, [[8, 9], [10]], use_tqdm=False)
    expected = [float(hf_logits(hf, [5, 6, 7] + d)[0].sigmoid()) for d in ([8, 9], [10])]
    assert [o.outputs.score for o in by_ids] == pytest.approx(expected, abs=1e-6)


def test_what_a_classifier_refuses(tmp_path):
    path = tmp_path / "cls"
    save_classifier(configs()["llama-3-labels"], path)
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(path), **SMALL)  # a classifier cannot generate
    llm = LLM(str(path), runner="pooling", **SMALL)
    with pytest.raises(ValueError, match="LLM.classify"):
        llm.embed([PROMPTS[0]], use_tqdm=False)
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.score([5, 6], [[7, 8]], use_tqdm=False)  # three labels: not a cross-encoder
    with pytest.raises(ValueError, match="dimensions"):
        llm.classify([PROMPTS[0]], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="activation"):
        llm.classify([PROMPTS[0]], PoolingParams(activation="yes"), use_tqdm=False)
    with pytest.raises(ValueError, match="ALL"):
        LLM(str(path), runner="pooling", pooler_config={"pooling_type": "ALL"}, **SMALL)
    from paged_llm.models.loader import load_model

    model, _ = load_model(path)
    with pytest.raises(RuntimeError, match="does not generate"):
        model.compute_logits(torch.zeros(1, 64))


def test_classify_needs_a_classifier(tmp_path):
    config = transformers.Qwen3Config(**LLAMA_LIKE, vocab_size=256)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="sequence-classification"):
        LLM(str(tmp_path), runner="pooling", **SMALL).classify([PROMPTS[0]], use_tqdm=False)
    with pytest.raises(ValueError, match="generates"):
        LLM(str(tmp_path), **SMALL).classify([PROMPTS[0]], use_tqdm=False)


def test_server_classify_score_and_rerank(cross_encoder, tmp_path):
    """/classify with label names; /v1/score and /rerank (also /v1 and /v2) on a cross-encoder
    equal LLM.score, ranked best first and cut at top_n; embeddings refused there."""
    import httpx

    from paged_llm.serve.background import ServerThread
    from paged_llm.serve.cli import build, make_parser

    path, _ = cross_encoder
    query, docs = "what is paged attention", ["a sorting algorithm", "blocks of the KV cache",
                                               "memory pages"]  # fmt: skip
    expected = [o.outputs.score for o in LLM(str(path), task="score", **SMALL).score(
        query, docs, use_tqdm=False)]  # fmt: skip
    common = ["--served-model-name", "m", "--cpu-kv-cache-gib", "0.01", "--disable-log-stats",
              "--block-size", "4", "--runner", "pooling"]  # fmt: skip
    with ServerThread(build(make_parser().parse_args([str(path), *common]))) as srv:
        r = httpx.post(srv.url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60)
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(expected, abs=1e-6)
        for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = httpx.post(srv.url + route, json={"query": query, "documents": docs, "top_n": 2},
                           timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            best = sorted(range(3), key=lambda i: -expected[i])[:2]
            assert [x["index"] for x in results] == best
            assert [x["document"]["text"] for x in results] == [docs[i] for i in best]
            assert [x["relevance_score"] for x in results] == pytest.approx(
                [expected[i] for i in best], abs=1e-6
            )
        r = httpx.post(srv.url + "/rerank", json={"query": query, "documents": []}, timeout=60)
        assert r.status_code == 400
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
        assert r.status_code == 400 and "/classify" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/classify", json={"input": [[5, 6, 7], [8]]}, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["num_classes"] for d in data] == [1, 1] and data[0]["label"] == "LABEL_0"

    labelled = tmp_path / "labelled"
    config = configs()["llama-3-labels"]
    config.id2label = {0: "negative", 1: "neutral", 2: "positive"}
    config.label2id = {v: k for k, v in config.id2label.items()}
    hf = save_classifier(config, labelled)
    with ServerThread(build(make_parser().parse_args([str(labelled), *common]))) as srv:
        r = httpx.post(srv.url + "/v1/classify", json={"input": PROMPTS[:2]}, timeout=60)
        assert r.status_code == 200, r.text
        for prompt, d in zip(PROMPTS[:2], r.json()["data"]):
            probs = hf_logits(hf, prompt).softmax(-1)
            assert d["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
            assert d["label"] == config.id2label[int(probs.argmax())]
        r = httpx.post(srv.url + "/rerank", json={"query": [5], "documents": [[6]]}, timeout=60)
        assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"]


@pytest.mark.distributed
def test_tensor_parallel_classifier_matches_transformers(tmp_path):
    """Two ranks: the decoder is split, the score head replicated; rank 0 classifies."""
    config = configs()["llama-3-labels"]
    hf = save_classifier(config, tmp_path)
    with LLM(str(tmp_path), runner="pooling", tensor_parallel_size=2, **SMALL) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_logits(hf, prompt).softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["Mistral", "Qwen2", "OPT"])
def test_bare_decoder_checkpoints_embed_like_transformers(kind, tmp_path):
    """HF ``*Model`` checkpoints (the decoder alone, tensors without ``model.``, as e5-mistral
    and gte-Qwen2 ship): their last-token embeddings equal transformers' last_hidden_state;
    they cannot generate."""
    import torch.nn.functional as F

    t = transformers
    config = {
        "Mistral": lambda: t.MistralConfig(**LLAMA_LIKE, vocab_size=256),
        "Qwen2": lambda: t.Qwen2Config(**LLAMA_LIKE, vocab_size=256),
        "OPT": lambda: t.OPTConfig(**{k: v for k, v in COMMON.items() if k != "initializer_range"},
                                   vocab_size=256, ffn_dim=96, num_hidden_layers=2),
    }[kind]()  # fmt: skip
    torch.manual_seed(0)
    hf = t.AutoModel.from_config(config).eval()
    assert type(hf).__name__ == f"{kind}Model"
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), runner="pooling", **SMALL)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            last = hf(torch.tensor([prompt])).last_hidden_state[0, -1].float()
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding), F.normalize(last, dim=-1), atol=1e-5, rtol=0
        )
    with pytest.raises(ValueError, match="no LM head"):
        LLM(str(tmp_path), **SMALL)
