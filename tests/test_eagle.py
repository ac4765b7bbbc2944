"""EAGLE drafting: the paged head against its transformers reference, exactness of the
outputs, the head's cache under prefix caching, forks and preemption, and a trained head."""

import logging
from collections import Counter

import pytest
import torch
from graph_replay import replay_graphs_eagerly
from safetensors.torch import load_file
from test_spec import PROMPTS, assert_same_logprobs, greedy, ids_of, save_llama

from paged_llm import LLM, SamplingParams
from paged_llm.models.eagle import random_eagle_head
from paged_llm.recipes.eagle import EagleHeadReference, shifted_features, target_features
from paged_llm.runner.cuda_graphs import capture_sizes, mixed_capture_tokens

SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # a common prefix longer than two blocks of 4
PREFIXED = [SHARED + [20 + i, 3 * i + 1] for i in range(4)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, head dir, transformers target, reference head with the same weights)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("eagle")
    target = save_llama(root / "target")
    head = random_eagle_head(target, root / "head", seed=3)
    hf = tf.LlamaForCausalLM.from_pretrained(str(target)).eval()
    ref = EagleHeadReference(tf.AutoConfig.from_pretrained(str(head))).eval()
    missing, unexpected = ref.load_state_dict(load_file(str(head / "model.safetensors")),
                                              strict=False)  # fmt: skip
    assert not unexpected and all("rotary" in m for m in missing)
    return target, head, hf, ref


@torch.no_grad()
def reference_drafts(hf, ref, tokens: list[int], k: int) -> list[int]:
    """k greedy drafts after ``tokens`` from whole-sequence transformers forwards: the target's
    features of the context, then the head's own predictions fed back."""
    ids = torch.tensor([tokens])
    feats, _ = target_features(hf, ids[:, :-1])  # f_0..f_{b-1}, b = len(tokens) - 1
    inputs = shifted_features(torch.cat([feats, feats[:, -1:]], dim=1))  # f_{-1}..f_{b-1}
    drafts = []
    for _ in range(k):
        pred = ref(hf.get_input_embeddings()(ids), inputs)[:, -1]  # predicted f at the end
        tok = int(hf.lm_head(pred).argmax(-1))
        drafts.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
        inputs = torch.cat([inputs, pred[:, None]], dim=1)
    return drafts


def recorded_proposals(llm):
    """Wrap the engine's drafter to record (context tokens, drafts) of every proposal."""
    drafter, seen = llm.llm_engine.drafter, []
    propose = drafter.propose

    def record(entries, sampler):
        drafts, probs = propose(entries, sampler)
        seen.extend((list(s.request.all_token_ids), drafts[s.request.request_id]) for s in entries)
        return drafts, probs

    drafter.propose = record
    return seen


def eagle_llm(pair, k=3, spec_extra=None, **kw):
    target, head, *_ = pair
    spec = {
        "method": "eagle",
        "model": str(head),
        "num_speculative_tokens": k,
        **(spec_extra or {}),
    }
    kw = {"block_size": 4, "max_model_len": 64, "cpu_kv_cache_gib": 0.01, **kw}
    return LLM(str(target), speculative_config=spec, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"enable_prefix_caching": True},
        {"num_gpu_blocks_override": 24, "preemption_mode": "swap", "swap_space": 0.01},
        {"num_gpu_blocks_override": 24, "preemption_mode": "recompute"},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 8},
    ],
    ids=["plain", "prefix-caching", "swap", "recompute", "chunked-prefill"],
)
def test_drafts_equal_the_transformers_reference(pair, kw):
    """Every draft the paged head proposes, in a batch, equals what the whole-sequence
    reference drafts from the same context: the head's cache is right after prefix hits,
    chunked prompts, swaps and recomputation, and after each rollback."""
    llm = eagle_llm(pair, **kw)
    seen = recorded_proposals(llm)
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + PREFIXED]
    # every other request also wants logprobs: those draft (and keep the head's cache) too
    with_logprobs = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    llm.generate(prompts, [with_logprobs if i % 2 else greedy(10) for i in range(len(prompts))])
    llm.generate(prompts[len(PROMPTS) :], greedy(10))  # hits on the first call's blocks
    _, _, hf, ref = pair
    assert len(seen) > 40
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, ref, tokens, len(drafts)), tokens
    engine = llm.llm_engine
    if "preemption_mode" in kw:
        assert engine.scheduler.num_preemptions_total > 0
    if kw.get("enable_prefix_caching"):
        assert engine.scheduler.kv.prefix_hits > 0


def test_drafts_after_a_pause_equal_the_reference(pair):
    """disable_by_batch_size=3: no drafts while the batch is large, and observe skips its first
    draft step then; when the batch shrinks, propose runs that step itself and every draft
    still equals the whole-sequence reference."""
    llm = eagle_llm(pair, spec_extra={"disable_by_batch_size": 3})
    seen = recorded_proposals(llm)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    engine, firsts = llm.llm_engine, []
    step = engine.step

    def step_and_count():  # first draft steps observe kept, and whether drafting was paused
        outs = step()
        firsts.append((len(engine.drafter._first), engine.scheduler.drafts.drafts_next_step()))
        return outs

    engine.step = step_and_count
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(n == 0 for n, drafting in firsts if not drafting)
    assert any(n > 0 for n, drafting in firsts if drafting)
    _, _, hf, ref = pair
    assert len(seen) > 5
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, ref, tokens, len(drafts)), tokens


def test_drafts_through_replayed_graphs_equal_the_reference(pair, monkeypatch):
    """With CUDA graphs (replayed eagerly here): the target verifies at stride k + 1, the head
    runs observe at stride k + 2 and its draft steps at stride 1, reading its features from
    the graphs' static buffer; every draft still equals the whole-sequence reference."""
    llm = eagle_llm(pair, max_num_seqs=4, attention_backend="triton")
    graphs = replay_graphs_eagerly(llm, monkeypatch, capture_sizes(4), strides=(1, 4))
    seen = recorded_proposals(llm)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], greedy(10))
    _, _, hf, ref = pair
    assert len(seen) > 10
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, ref, tokens, len(drafts)), tokens
    assert any(s == 4 for _, s in graphs.replays)
    assert {s for _, s in llm.llm_engine.drafter.cuda_graphs.replays} == {1, 5}


def test_drafts_through_mixed_graphs_equal_the_reference(pair, monkeypatch):
    """Prompts arriving one per step beside verifications: the target replays mixed-step graphs
    and the head reads its features from their static output; drafts equal the reference."""
    llm = eagle_llm(pair, max_num_seqs=4, attention_backend="triton")
    replay_graphs_eagerly(llm, monkeypatch, capture_sizes(4), strides=(1, 4),
                          mixed_tokens=mixed_capture_tokens(64))  # fmt: skip
    seen = recorded_proposals(llm)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(10))
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    _, _, hf, ref = pair
    assert len(seen) > 10
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, ref, tokens, len(drafts)), tokens
    assert engine.runner.forward_kinds["graph_mixed"] > 0


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_outputs_equal_the_target_alone(pair, k):
    plain = LLM(str(pair[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = ids_of(plain.generate(prompts, greedy(12)))
    llm = eagle_llm(pair, k=k)
    assert ids_of(llm.generate(prompts, greedy(12))) == want
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    assert llm.llm_engine.kv_usage() == 0
    # with logprobs: still speculating, the same tokens and each token's logprobs
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    drafted = llm.llm_engine.spec_stats.num_draft_tokens  # (the random head's are rejected)
    a, b = plain.generate(prompts, sp), llm.generate(prompts, sp)
    assert llm.llm_engine.spec_stats.num_draft_tokens > drafted
    assert ids_of(b) == want
    for oa, ob in zip(a, b):
        assert_same_logprobs(oa.outputs[0].logprobs, ob.outputs[0].logprobs)


def test_observe_runs_the_first_draft_step_where_the_block_allows(pair):
    """A proposal at position b runs k - 1 head forwards when b shares b-1's block (observe ran
    the first with the target's new feature) and k at a block boundary; drafts stay those of
    the whole-sequence reference."""
    llm = eagle_llm(pair, k=3)
    drafter = llm.llm_engine.drafter
    run, propose, calls = drafter._run, drafter.propose, []

    def counting_run(*args):
        if calls and calls[-1]["open"]:
            calls[-1]["forwards"] += 1
        return run(*args)

    def counting_propose(entries, sampler):
        (s,) = entries
        calls.append({"b": s.request.num_computed_tokens, "lookahead": s.num_lookahead,
                      "forwards": 0, "open": True})  # fmt: skip
        try:
            return propose(entries, sampler)
        finally:
            calls[-1]["open"] = False

    drafter._run, drafter.propose = counting_run, counting_propose
    seen = recorded_proposals(llm)
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(20))
    for c in calls:
        assert c["forwards"] == c["lookahead"] - (1 if c["b"] % 4 else 0), c
    assert {c["b"] % 4 == 0 for c in calls} == {True, False}  # both kinds of position ran
    _, _, hf, ref = pair
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, ref, tokens, len(drafts)), tokens


def test_parallel_samples_draft_from_shared_blocks(pair):
    """n > 1: samples 2..n fork the first one's prompt blocks (the head's pools with them) and
    recompute its last token; each drafts what the reference drafts from its own context."""
    llm = eagle_llm(pair, k=2)
    seen = recorded_proposals(llm)
    for prompt in (PROMPTS[2], PROMPTS[2][:9]):  # the fork point mid-block and block-aligned
        params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert [len(c.token_ids) for c in out[0].outputs] == [8, 8, 8]
    _, _, hf, ref = pair
    firsts = [t for t, _ in seen if len(t) in (len(PROMPTS[2]) + 1, 10)]
    assert len(firsts) >= 6  # every sample's first proposal among them
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, ref, tokens, len(drafts)), tokens


def test_sampled_outputs_keep_the_target_distribution(tmp_path):
    """Two-sample chi-square on a 6-token vocabulary: the second and third generated tokens'
    marginals are the same with and without an (untrained) EAGLE head."""
    target = save_llama(tmp_path / "t", vocab=6, hidden=32, layers=1, seed=0)
    head = random_eagle_head(target, tmp_path / "h", seed=1)
    n = 600
    prompts = [{"prompt_token_ids": [1, 2, 3]}] * n
    kw = dict(block_size=4, max_model_len=32, cpu_kv_cache_gib=0.01)

    def tokens(llm, seed0):
        params = [SamplingParams(temperature=1.0, seed=seed0 + s, max_tokens=3, ignore_eos=True)
                  for s in range(n)]  # fmt: skip
        return ids_of(llm.generate(prompts, params, use_tqdm=False))

    plain = tokens(LLM(str(target), **kw), 0)
    spec = {"method": "eagle", "num_speculative_tokens": 2, "model": str(head)}
    llm = LLM(str(target), speculative_config=spec, **kw)
    specd = tokens(llm, 10_000)
    stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for pos in (1, 2):
        a, b = Counter(o[pos] for o in plain), Counter(o[pos] for o in specd)
        chi2 = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in range(6) if a[t] + b[t])
        assert chi2 < 20.5  # 99.9% quantile, 5 degrees of freedom


def test_the_head_sleeps_with_the_target(pair):
    """Sleep level 2 discards the head's pools with the target's KV cache and keeps its
    weights (load_weights never writes them); after waking it drafts as the reference does."""
    llm = eagle_llm(pair, k=2, enable_sleep_mode=True, enable_prefix_caching=True)
    drafter = llm.llm_engine.drafter
    prompts = [{"prompt_token_ids": p} for p in PREFIXED]
    before = ids_of(llm.generate(prompts, greedy(8), use_tqdm=False))
    weights = [p.detach().clone() for p in drafter.head.parameters()]
    llm.sleep(2)
    pools = [t for group in drafter.block_pools("device") for t in group]
    assert all(t.untyped_storage().nbytes() == 0 for t in pools)
    llm.wake_up()
    llm.load_weights(load_file(str(pair[0] / "model.safetensors")).items())
    assert all(torch.equal(a, b) for a, b in zip(weights, drafter.head.parameters()))
    seen = recorded_proposals(llm)
    assert ids_of(llm.generate(prompts, greedy(8), use_tqdm=False)) == before
    _, _, hf, ref = pair
    assert seen and all(d == reference_drafts(hf, ref, t, len(d)) for t, d in seen)


def test_the_heads_graphs_are_captured_again_after_a_sleep(pair, monkeypatch):
    """A sleep drops the head's graphs with the target's (they bake in the pools' addresses);
    waking captures both again, and drafting through them still matches the reference."""
    llm = eagle_llm(pair, k=2, enable_sleep_mode=True, max_num_seqs=4, attention_backend="triton")
    replay_graphs_eagerly(llm, monkeypatch, capture_sizes(4), strides=(1, 3))
    drafter, runner = llm.llm_engine.drafter, llm.llm_engine.runner
    prompts = [{"prompt_token_ids": p} for p in PREFIXED[:2]]
    before = ids_of(llm.generate(prompts, greedy(8), use_tqdm=False))
    llm.sleep(1)
    assert drafter.cuda_graphs is None and runner.cuda_graphs is None
    llm.wake_up()
    assert drafter.cuda_graphs is not None and drafter.cuda_graphs.replays == []
    seen = recorded_proposals(llm)
    assert ids_of(llm.generate(prompts, greedy(8), use_tqdm=False)) == before
    assert {s for _, s in drafter.cuda_graphs.replays} == {1, 4}
    _, _, hf, ref = pair
    assert seen and all(d == reference_drafts(hf, ref, t, len(d)) for t, d in seen)


def test_what_eagle_cannot_be_combined_with(pair, tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        eagle_llm(pair, enable_prefix_caching=True, kv_offloading_size=0.01)
    with pytest.raises(ValueError, match="not an EAGLE head"):
        LLM(str(pair[0]), speculative_config={"method": "eagle", "model": str(pair[0]),
                                              "num_speculative_tokens": 2})  # fmt: skip
    other = random_eagle_head(save_llama(tmp_path / "wide", hidden=128), tmp_path / "wide-head")
    with pytest.raises(ValueError, match="does not fit the target"):
        LLM(str(pair[0]), speculative_config={"method": "eagle", "model": str(other),
                                              "num_speculative_tokens": 2})  # fmt: skip


# ---- the built-in trained head ------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_pair():
    from paged_llm.models import trained

    return trained.trained_model_dir("test-target"), trained.trained_model_dir("test-eagle")


def test_trained_head_is_recorded_and_agrees_with_its_target(trained_pair):
    from paged_llm.models import trained

    info = trained.training_info("test-eagle")
    assert info["recipe_key"] == trained.recipe("test-eagle").key()
    assert info["loss_curve"][-1] < 0.5 * info["loss_curve"][0]
    assert info["heldout_teacher_top1_agreement"] > 0.6  # first drafts, teacher-forced
    config = __import__("json").loads((trained_pair[1] / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaHead"] and config["num_hidden_layers"] == 1


def test_trained_head_drafts_are_accepted(trained_pair):
    """On held-out code, greedy: most of the trained head's drafts are accepted (an untrained
    head's almost never are), and the outputs are the target's."""
    from paged_llm.models.trained import corpus_tokens

    target, head = (str(p) for p in trained_pair)
    ids = [int(t) for t in corpus_tokens("test-target", "heldout")]
    prompts = [{"prompt_token_ids": ids[i * 500 : i * 500 + 24]} for i in range(6)]
    kw = dict(block_size=16, max_model_len=128, cpu_kv_cache_gib=0.02)
    want = ids_of(LLM(target, **kw).generate(prompts, greedy(24), use_tqdm=False))
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=spec, **kw)
    assert ids_of(llm.generate(prompts, greedy(24), use_tqdm=False)) == want
    stats = llm.llm_engine.spec_stats
    assert stats.acceptance_rate > 0.4, stats.as_dict()
    assert stats.mean_acceptance_length > 1.8


def test_a_heads_key_follows_its_targets_recipe(monkeypatch):
    from dataclasses import replace

    from paged_llm.models import trained

    key = trained.recipe("eagle").key()
    changed = replace(
        trained.RECIPES["target"], train=replace(trained.RECIPES["target"].train, steps=1)
    )
    monkeypatch.setitem(trained.RECIPES, "target", changed)
    assert trained.recipe("eagle").key() != key
    assert trained.recipe("eagle").corpus == trained.recipe("target").corpus
