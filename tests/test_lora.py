"""Multi-LoRA serving against PEFT itself: adapters written by PEFT's ``save_pretrained`` on tiny
transformers models, outputs compared with the PeftModel's (logits and greedy tokens), several
adapters and the base model in one batch, the max_loras limit, prefix caching, and bad input."""

from __future__ import annotations

import copy
import json

import peft  # a dev dependency: the reference implementation
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batch_fuzz import PROMPTS as FUZZ_PROMPTS
from test_batch_fuzz import engine_configs

from paged_llm import LLM, SamplingParams
from paged_llm.lora.request import LoRARequest
from paged_llm.lora.slots import LoRASlots

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33, 40], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [77, 12]]
LLAMA_TARGETS = {
    "a1": (["q_proj", "v_proj", "down_proj"], 8, 16, {}),
    "a2": (["k_proj", "o_proj", "gate_proj", "up_proj"], 4, 4, {"use_rslora": True}),
    "a3": (
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        2,
        8,
        {},
    ),  # fmt: skip
}


def write_adapter(base_dir, out_dir, targets, r, alpha, seed, **extra):
    """Save a PEFT LoRA adapter with random (non-zero) A and B; return the PeftModel."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(base_dir))
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                             init_lora_weights=False, **extra)  # fmt: skip
    pm = peft.get_peft_model(model, config)
    for name, p in pm.named_parameters():
        if "lora_B" in name:  # PEFT's own init leaves B at zero or tiny: make the delta visible
            torch.nn.init.normal_(p, std=0.3)
    pm.save_pretrained(str(out_dir))
    return pm.eval()


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama, tmp_path_factory):
    """(base dir, base HF model, {name: (LoRARequest, PeftModel)}) for three Llama adapters."""
    base_dir, base = tiny_llama
    root = tmp_path_factory.mktemp("llama-loras")
    adapters = {}
    for i, (name, (targets, r, alpha, extra)) in enumerate(LLAMA_TARGETS.items()):
        pm = write_adapter(base_dir, root / name, targets, r, alpha, seed=i, **extra)
        adapters[name] = (LoRARequest(name, i + 1, str(root / name)), pm)
    return base_dir, base, adapters


@torch.no_grad()
def hf_greedy(model, prompt, n=10):
    """The reference's greedy continuation, EOS included like any token (as ignore_eos=True;
    ``generate(min_new_tokens=...)`` would mask EOS instead)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def engine(base_dir, **kw):
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", seed=0)
    return LLM(model=str(base_dir), **{**args, **kw})


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_batch_matches_peft(llama_adapters):
    """Two adapters and the base model in one batch: each prompt's greedy tokens are PEFT's."""
    base_dir, base, adapters = llama_adapters
    (r1, p1), (r2, p2) = adapters["a1"], adapters["a2"]
    llm = engine(base_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                        use_tqdm=False, lora_request=[r1, r2, None])  # fmt: skip
    expected = [hf_greedy(m, p) for m, p in zip((p1, p2, base), PROMPTS)]
    assert token_ids(outs) == expected
    assert outs[0].lora_request == r1 and outs[2].lora_request is None
    # the adapters matter: the base model continues the first two prompts differently
    assert [hf_greedy(base, p) for p in PROMPTS[:2]] != expected[:2]


def assert_prompt_logprobs_match(llm, req, peft_model, prompt):
    """Every prompt position's log-probability under the adapter equals PEFT's within 1e-4."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=req)[0]
    ours = torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    with torch.no_grad():
        logits = peft_model(torch.tensor([prompt])).logits[0, :-1].float()
    ref = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_logits_match_peft(llama_adapters):
    """Every prompt position's log-probability equals PEFT's within 1e-4 (float32)."""
    base_dir, _, adapters = llama_adapters
    llm = engine(base_dir, max_loras=3)
    for name in ("a1", "a2", "a3"):
        req, pm = adapters[name]
        assert_prompt_logprobs_match(llm, req, pm, PROMPTS[1])


def test_rank_and_alpha_patterns_match_peft(tiny_llama, tmp_path):
    """PEFT's per-module rank_pattern and alpha_pattern change each module's scaling."""
    base_dir, _ = tiny_llama
    pm = write_adapter(base_dir, tmp_path / "patterns", ["q_proj", "v_proj", "up_proj"], r=4,
                       alpha=8, seed=4, rank_pattern={"q_proj": 2},
                       alpha_pattern={"v_proj": 32, "layers.1.mlp.up_proj": 1})  # fmt: skip
    req = LoRARequest("patterns", 3, str(tmp_path / "patterns"))
    assert_prompt_logprobs_match(engine(base_dir), req, pm, PROMPTS[1])


def test_opt_adapter_matches_peft(tiny_opt, tmp_path):
    base_dir, base = tiny_opt
    pm = write_adapter(base_dir, tmp_path / "opt-lora", ["q_proj", "out_proj", "fc1", "fc2"],
                       r=4, alpha=8, seed=3)  # fmt: skip
    llm = engine(base_dir, max_loras=1)
    req = LoRARequest("opt", 7, str(tmp_path / "opt-lora"))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                        use_tqdm=False, lora_request=req)  # fmt: skip
    assert token_ids(outs) == [hf_greedy(pm, p) for p in PROMPTS]


@pytest.mark.parametrize(
    "kind, targets",
    [
        ("gpt2", ["c_attn", "c_proj", "c_fc"]),  # Conv1D layers; c_attn fused q/k/v
        ("gpt_neox", ["query_key_value", "dense", "dense_4h_to_h"]),  # q/k/v fused per head
    ],
)
def test_fused_qkv_adapters_match_peft(kind, targets, tmp_path):
    """Adapters of a fused q/k/v layer apply to the q, k and v this engine splits it into."""
    import transformers as tf

    config = {
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=256, n_embd=64, n_head=4, n_layer=2, n_positions=128
        ),  # fmt: skip
        "gpt_neox": lambda: tf.GPTNeoXConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_hidden_layers=2,
            rotary_pct=0.25,
        ),  # fmt: skip
    }[kind]()
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "base"))
    pm = write_adapter(tmp_path / "base", tmp_path / "lora", targets, r=4, alpha=8, seed=5)
    llm = engine(tmp_path / "base", max_loras=1)
    req = LoRARequest(kind, 3, str(tmp_path / "lora"))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                        use_tqdm=False, lora_request=req)  # fmt: skip
    assert token_ids(outs) == [hf_greedy(pm, p) for p in PROMPTS]
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert token_ids(base) != token_ids(outs)  # the adapter changed something


def test_new_base_weights_keep_the_adapters_on_top(llama_adapters, tmp_path):
    """load_weights writes the base layers under the adapters (LoRALinear's ``base``): with
    and without an adapter, greedy tokens are PEFT's on the updated base model."""
    base_dir, base, adapters = llama_adapters
    request, _ = adapters["a1"]
    llm = engine(base_dir)
    new_base = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(7)
    changed = {}
    with torch.no_grad():
        for name, p in new_base.named_parameters():
            if ".layers.1." in name:  # q/k/v/o (adapted) and the MLP
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
                changed[name] = p.detach().clone()
    assert llm.load_weights(changed.items()) == len(changed)
    reference = peft.PeftModel.from_pretrained(copy.deepcopy(new_base), request.lora_path).eval()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False,
                        lora_request=[request, None])  # fmt: skip
    assert token_ids(outs) == [hf_greedy(reference, PROMPTS[0]), hf_greedy(new_base, PROMPTS[1])]


def test_one_slot_serves_many_adapters_in_turn(llama_adapters):
    """max_loras=1 and max_cpu_loras=1 with three adapters: no step mixes adapters, adapters
    are reloaded from disk when the CPU cache dropped them, and outputs equal PEFT's."""
    base_dir, base, adapters = llama_adapters
    llm = engine(base_dir, max_loras=1, max_cpu_loras=1)
    manager = llm.llm_engine.lora
    seen = []
    activate = manager.activate

    def spy(lora_ids, query_lens):
        seen.append({i for i in lora_ids if i})
        activate(lora_ids, query_lens)

    manager.activate = spy
    names = ["a1", "a2", "a3", "a1", None, "a2"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    reqs = [adapters[n][0] if n else None for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        use_tqdm=False, lora_request=reqs)  # fmt: skip
    models = [adapters[n][1] if n else base for n in names]
    assert token_ids(outs) == [hf_greedy(m, p) for m, p in zip(models, prompts)]
    assert seen and all(len(s) <= 1 for s in seen)
    assert len({frozenset(s) for s in seen if s}) == 3


def test_prefix_cache_keeps_adapters_apart(llama_adapters):
    """The same prompt under an adapter and under the base model shares no cached block; the
    same adapter again hits the cache; outputs equal the uncached ones."""
    base_dir, base, adapters = llama_adapters
    req, pm = adapters["a1"]
    prompt = list(range(3, 40))  # two full blocks of 16 and a bit
    llm = engine(base_dir, enable_prefix_caching=True)
    runs = [(req, pm), (None, base), (req, pm)]
    outs = [llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                         lora_request=r)[0] for r, _ in runs]  # fmt: skip
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32]
    assert token_ids(outs) == [hf_greedy(m, prompt) for _, m in runs]


def test_int8_base_with_adapter_matches_peft_on_dequantized_weights(llama_adapters):
    """A quantized base layer keeps its adapter: int8 weights + LoRA equal PEFT on a model
    holding the same int8 weights dequantized."""
    import transformers as tf

    base_dir, _, adapters = llama_adapters
    req, _ = adapters["a1"]
    llm = engine(base_dir, quantization="int8")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                        use_tqdm=False, lora_request=req)  # fmt: skip
    model = tf.AutoModelForCausalLM.from_pretrained(str(base_dir))
    with torch.no_grad():
        for name, layer in llm.llm_engine.lora.layers.items():
            model.get_submodule(name).weight.copy_(layer.base.dequantize())
    pm = peft.PeftModel.from_pretrained(model, req.lora_path).eval()
    assert token_ids(outs) == [hf_greedy(pm, p) for p in PROMPTS]


def test_beam_search_with_adapters_matches_peft(llama_adapters):
    """Beams fork with their adapter: the best beam of each prompt (one adapter each, and the
    base model) equals transformers' beam search on the PeftModel."""
    from paged_llm import BeamSearchParams

    base_dir, base, adapters = llama_adapters
    (r1, p1), (r2, p2) = adapters["a1"], adapters["a2"]
    llm = engine(base_dir, block_size=4)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params,
                           lora_request=[r1, r2, None])  # fmt: skip
    for prompt, out, model in zip(PROMPTS, outs, (p1, p2, base)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                early_stopping=False, length_penalty=1.0,
            )  # fmt: skip
        assert out.sequences[0].tokens[len(prompt) :] == ref[0, len(prompt) :].tolist()
    assert llm.llm_engine.kv_usage() == 0


def test_engine_add_list_remove(llama_adapters):
    base_dir, _, adapters = llama_adapters
    eng = engine(base_dir).llm_engine
    r1, r2 = adapters["a1"][0], adapters["a2"][0]
    assert eng.add_lora(r1) is True and eng.add_lora(r1) is False
    eng.add_lora(r2)
    assert eng.list_loras() == {1, 2}
    eng.add_request("x", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=r2)
    with pytest.raises(ValueError, match="in use"):
        eng.remove_lora(2)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.remove_lora(2) is True and eng.list_loras() == {1}


def test_metrics_name_the_adapters_of_running_and_waiting_requests(llama_adapters):
    """vLLM's vllm:lora_requests_info gauge: max_lora and the adapters in use, by name."""
    from paged_llm.serve.metrics import LoRAGauges, ServerMetrics, engine_gauges

    base_dir, _, adapters = llama_adapters
    eng = engine(base_dir).llm_engine
    eng.add_request("x", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=adapters["a1"][0])
    assert engine_gauges(eng).lora == LoRAGauges(2, (), ("a1",))
    eng.step()
    gauges = engine_gauges(eng)
    assert gauges.lora == LoRAGauges(2, ("a1",), ())
    text = ServerMetrics("m").render(gauges)
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",' \
           'waiting_lora_adapters=""}' in text  # fmt: skip
    while eng.has_unfinished_requests():
        eng.step()
    assert "lora_requests_info" not in ServerMetrics("m").render(
        engine_gauges(LLM("tiny").llm_engine)
    )


# ---- bad input ------------------------------------------------------------------------------
def rewrite_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_before_any_work(llama_adapters, tiny_llama, tmp_path):
    base_dir, _, adapters = llama_adapters
    r1 = adapters["a1"][0]
    path = r1.lora_path
    with pytest.raises(ValueError, match="not enabled"):
        LLM(model=str(base_dir)).generate([PROMPTS[0]], GREEDY, lora_request=r1)
    llm = engine(base_dir, max_lora_rank=4)
    cases = {
        "rank 8 .* exceeds max_lora_rank=4": r1,
        "no such directory": LoRARequest("gone", 9, str(tmp_path / "missing")),
        "DoRA": LoRARequest("dora", 10, str(rewrite_config(path, tmp_path / "d", use_dora=True))),
        "bias='all'": LoRARequest("b", 11, str(rewrite_config(path, tmp_path / "b", bias="all"))),
        "modules_to_save": LoRARequest(
            "m", 12, str(rewrite_config(path, tmp_path / "m", modules_to_save=["lm_head"]))
        ),
        "expected a LoRARequest": "a1",
    }
    good = adapters["a2"][0]
    for message, req in cases.items():
        with pytest.raises(ValueError, match=f"prompt 1: .*{message}"):
            llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, lora_request=[good, req])
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, path)
    with pytest.raises(ValueError, match="already names adapter 'a2'"):
        llm.generate(
            [PROMPTS[0]], GREEDY, lora_request=LoRARequest("other", good.lora_int_id, path)
        )
    # the engine still serves correct requests afterwards
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request=good, use_tqdm=False)


def test_adapters_for_other_models_are_refused(llama_adapters, tmp_path):
    """An adapter of another base model (other widths) or of layers this engine does not adapt
    (embeddings) fails with the module named."""
    from conftest import save_tiny

    base_dir = llama_adapters[0]
    other = tmp_path / "wide"
    save_tiny("llama", other, hidden_size=96, intermediate_size=64)
    write_adapter(other, tmp_path / "wide-lora", ["q_proj"], r=4, alpha=4, seed=0)
    write_adapter(base_dir, tmp_path / "emb-lora", ["embed_tokens", "q_proj"], r=4, alpha=4,
                  seed=0)  # fmt: skip
    llm = engine(base_dir)
    with pytest.raises(ValueError, match=r"q_proj' has lora_A \(4, 96\)"):
        llm.generate(
            [PROMPTS[0]], GREEDY, lora_request=LoRARequest("w", 5, str(tmp_path / "wide-lora"))
        )
    with pytest.raises(ValueError, match="embedding adapters"):
        llm.generate(
            [PROMPTS[0]], GREEDY, lora_request=LoRARequest("e", 6, str(tmp_path / "emb-lora"))
        )


def test_unsupported_combinations_are_refused(tiny_llama):
    base_dir, _ = tiny_llama
    with pytest.raises(ValueError, match="speculative"):
        engine(base_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_cpu_loras"):
        engine(base_dir, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        engine(base_dir, max_loras=0)


# ---- slot bookkeeping (plain Python) --------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    max_loras=st.integers(1, 4),
    steps=st.lists(st.sets(st.integers(1, 7), max_size=4), max_size=30),
)
def test_slots_keep_resident_adapters_and_load_only_new_ones(max_loras, steps):
    slots = LoRASlots(max_loras)
    for ids in steps:
        ids = set(sorted(ids)[:max_loras])
        before = list(slots.slots)
        mapping, loads = slots.assign(ids)
        assert set(mapping) == ids and len(set(mapping.values())) == len(ids)
        assert all(slots.slots[s] == i for i, s in mapping.items())
        for i, s in mapping.items():  # a resident adapter never moves or reloads
            if i in before:
                assert before.index(i) == s and (s, i) not in loads
        assert sorted(i for _, i in loads) == sorted(ids - set(before))
    with pytest.raises(ValueError, match="max_loras"):
        slots.assign(set(range(1, max_loras + 2)))


# ---- server ---------------------------------------------------------------------------------
def test_server_selects_adapters_by_model_name(tmp_path):
    """--lora-modules: adapters listed in /v1/models and chosen by "model"; the text equals
    the offline engine's with the same adapter (itself checked against PEFT above)."""
    import httpx

    from paged_llm.models.presets import default_model_dir
    from paged_llm.serve.background import ServerThread
    from paged_llm.serve.cli import build, make_parser

    base = default_model_dir()
    path = tmp_path / "sql"
    write_adapter(base, path, ["q_proj", "v_proj", "up_proj"], r=4, alpha=8, seed=5)
    spec = json.dumps({"name": "js", "path": str(path), "base_model_name": "b0"})
    argv = [str(base), "--served-model-name", "base", "--enable-lora", "--lora-modules",
            f"sql={path}", spec, "--max-loras", "2", "--max-lora-rank", "8"]  # fmt: skip
    argv += ["--max-model-len", "128", "--cpu-kv-cache-gib", "0.01", "--disable-log-stats"]
    body = {"prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    with ServerThread(build(make_parser().parse_args(argv))) as srv:
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            ("base", None), ("sql", "base"), ("js", "b0")
        ]  # fmt: skip
        texts = {}
        for model in ("base", "sql", "js"):
            r = httpx.post(srv.url + "/v1/completions", json={**body, "model": model}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            texts[model] = r.json()["choices"][0]["text"]
        r = httpx.post(srv.url + "/v1/completions", json={**body, "model": "nope"}, timeout=30)
        assert r.status_code == 404
        # the serving benchmark names an adapter per request (vLLM's --lora-modules)
        from experiments import bench_serve

        bench = bench_serve.main(["--base-url", srv.url, "--model", "base", "--num-prompts", "6",
                                  "--lora-modules", "sql", "js", "--dataset-name", "random",
                                  "--random-input-len", "8", "--random-output-len", "6",
                                  "--quiet"])  # fmt: skip
        assert bench["completed"] == 6 and bench["failed"] == 0
        assert bench["lora_modules"] == ["sql", "js"]
    llm = LLM(model=str(base), enable_lora=True, max_lora_rank=8, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = llm.generate("def f(x):", params, use_tqdm=False,
                           lora_request=LoRARequest("sql", 1, str(path)))[0]  # fmt: skip
    assert texts["sql"] == texts["js"] == offline.outputs[0].text != texts["base"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lora-modules", "a=/x"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "expected NAME=PATH"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "used twice"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "bad JSON entry"),
        (["--enable-lora", "--max-loras", "0"], "max_loras must be an integer >= 1"),
    ],
)
def test_bad_lora_flags_fail_before_loading(flags, message):
    from paged_llm.config import EngineConfig
    from paged_llm.serve.cli import engine_kwargs, make_parser

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**engine_kwargs(make_parser().parse_args(["tiny", *flags])))


def test_server_refuses_a_bad_adapter_at_start_up(tmp_path):
    from paged_llm.serve.cli import build, make_parser

    argv = ["tiny", "--enable-lora", "--lora-modules", f"gone={tmp_path / 'missing'}",
            "--max-model-len", "128", "--cpu-kv-cache-gib", "0.01"]  # fmt: skip
    with pytest.raises(ValueError, match="LoRA adapter 'gone'.*no such directory"):
        build(make_parser().parse_args(argv))


def test_bench_serve_draws_an_adapter_per_request():
    from experiments.bench_serve import BenchRequest, assign_lora_modules, make_parser, request_body

    reqs = [BenchRequest([1, 2], 2, 3) for _ in range(40)]
    assign_lora_modules(reqs, ["a", "b"], seed=0)
    args = make_parser().parse_args(["--model", "base", "--lora-modules", "a", "b"])
    models = [request_body(args, r)["model"] for r in reqs]
    assert set(models) == {"a", "b"}
    again = [BenchRequest([1, 2], 2, 3) for _ in range(40)]
    assign_lora_modules(again, ["a", "b"], seed=0)
    assert [r.model for r in again] == models  # seeded
    assert request_body(args, BenchRequest([1], 1, 1))["model"] == "base"


# ---- random engines -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    """Two adapters of the built-in tiny model: {name: LoRARequest}."""
    from paged_llm.models.presets import default_model_dir

    root = tmp_path_factory.mktemp("tiny-loras")
    targets = {"a": ["q_proj", "v_proj", "down_proj"], "b": ["k_proj", "o_proj", "up_proj"]}
    for i, (name, modules) in enumerate(targets.items()):
        write_adapter(default_model_dir(), root / name, modules, r=4, alpha=8, seed=10 + i)
    return {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(targets)}


@pytest.fixture(scope="module")
def lora_reference(tiny_adapters):
    """(prompt, adapter, max_tokens) -> greedy tokens of the request alone on a plain engine."""
    llm = LLM("tiny", enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=96)
    cache: dict = {}

    def alone(prompt, name, max_tokens):
        key = (prompt, name, max_tokens)
        if key not in cache:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            lora = tiny_adapters[name] if name else None
            out = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
            cache[key] = out.outputs[0].token_ids
        return cache[key]

    return alone


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    cfg=engine_configs(),
    max_loras=st.integers(1, 2),
    requests=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([None, "a", "b"]), st.integers(1, 10)),
        min_size=1, max_size=6,
    ),
)  # fmt: skip
def test_adapters_on_random_engines(tiny_adapters, lora_reference, cfg, max_loras, requests):
    """Adapters and the base model mixed on random engines (small pools that preempt by
    recompute or swap, chunked prefill, prefix caching, Orca and static policies, priority
    order, any block size): every request gets exactly the tokens it gets alone, and no block
    is left behind."""
    cfg = {**cfg, "kv_cache_dtype": "auto", "quantization": None, "dtype": "float32"}
    cfg.pop("speculative_config", None)  # refused with LoRA (its own test)
    try:
        llm = LLM("tiny", enable_lora=True, max_loras=max_loras, max_lora_rank=8, **cfg)
    except ValueError:
        return
    prompts = [FUZZ_PROMPTS[p] for p, _, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for *_, m in requests]
    loras = [tiny_adapters[name] if name else None for _, name, _ in requests]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    for (p, name, m), out in zip(requests, outs):
        assert out.outputs[0].token_ids == lora_reference(FUZZ_PROMPTS[p], name, m)
    engine = llm.llm_engine
    assert engine.kv_usage() == 0 and engine.scheduler.kv.num_free_blocks() == engine.num_kv_blocks


def test_lora_bench_runs_and_agrees(tmp_path):
    """The benchmark's smoke run: every system timed, and the systems that must compute the
    same tokens do (an adapter merged into the weights may flip a near-tie, so it is reported,
    not asserted)."""
    from experiments.lora_bench import write
    from paper_repro.common import compose

    cfg = compose("lora_bench", ["requests=3", "prompt=8", "tokens=4", "rank=4", "adapters=2",
                                 "repeats=1"])  # fmt: skip
    doc = write(cfg, tmp_path)
    assert set(doc["systems"]) == {"base", "lora_unused", "one_adapter", "merged", "mixed",
                                   "serial"}  # fmt: skip
    assert all(s["output_tokens_per_s"] > 0 for s in doc["systems"].values())
    assert doc["token_agreement"]["mixed_vs_serial"] == 1.0
    assert doc["token_agreement"]["lora_unused_vs_base"] == 1.0
    assert doc["mode"] == "real" and (tmp_path / "lora_bench.json").is_file()


def test_adapters_load_and_unload_at_run_time(tmp_path, monkeypatch):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING), and /reset_prefix_cache."""
    import httpx

    from paged_llm.models.presets import default_model_dir
    from paged_llm.serve.background import ServerThread
    from paged_llm.serve.cli import build, make_parser

    base = default_model_dir()
    path = tmp_path / "sql"
    write_adapter(base, path, ["q_proj", "v_proj"], r=4, alpha=8, seed=6)
    argv = [str(base), "--served-model-name", "base", "--enable-lora", "--max-lora-rank", "8",
            "--enable-prefix-caching", "--max-model-len", "128", "--cpu-kv-cache-gib", "0.01",
            "--disable-log-stats"]  # fmt: skip
    body = {"prompt": "def f(x):\n    return x * 2\n\n" * 2, "max_tokens": 6, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    with ServerThread(build(make_parser().parse_args(argv))) as srv:  # no env: no routes
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"})
        assert r.status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    with ServerThread(build(make_parser().parse_args(argv))) as srv:

        def post(route, payload):
            return httpx.post(srv.url + route, json=payload, timeout=60)

        sql = {"lora_name": "sql", "lora_path": str(path)}
        assert post("/v1/completions", {**body, "model": "sql"}).status_code == 404
        r = post("/v1/load_lora_adapter", sql)
        assert r.status_code == 200 and "added successfully" in r.text
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("sql", "base")]
        texts = {}
        for model in ("sql", "base"):
            r = post("/v1/completions", {**body, "model": model})
            assert r.status_code == 200, r.text
            texts[model] = r.json()["choices"][0]["text"]
        assert texts["sql"] != texts["base"]
        assert post("/v1/load_lora_adapter", sql).status_code == 400  # already loaded
        r = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "no")})
        assert r.status_code == 400 and "no such directory" in r.text
        assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
        assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
        assert post("/v1/completions", {**body, "model": "sql"}).status_code == 404
        pool = srv.server.config.app.state.engine.engine.scheduler.kv.pool
        assert pool._cached  # the prompts' full blocks are cached
        assert post("/reset_prefix_cache", {}).status_code == 200
        assert not pool._cached
