"""Speculative decoding: exactness (greedy and sampled), rollback, metrics."""

import logging
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm import LLM, SamplingParams
from paged_llm.spec.base import Drafter
from paged_llm.spec.metrics import ALL_DRAFTS, SpecDecodeStats
from paged_llm.spec.ngram import NgramDrafter
from paged_llm.spec.rejection import expected_tokens_per_step, verify_greedy, verify_sampled

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(5)]


def save_llama(path, vocab=256, hidden=64, layers=2, seed=0):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(seed)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("draft"), hidden=32, layers=1, seed=1)


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ids_of(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- the pieces -------------------------------------------------------------------------------
def test_ngram_proposes_most_recent_continuation():
    d = NgramDrafter(num_speculative_tokens=3, prompt_lookup_max=2)
    assert d.propose_one([1, 2, 3, 9, 1, 2, 4, 5, 1, 2]) == [4, 5, 1]
    assert d.propose_one([7, 8, 9]) == []


def ngram_reference(tokens, k, max_n, min_n):
    """The n-gram rule spelled out: longest suffix first, most recent earlier match."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),  # vocabulary: small ones match often
    st.integers(0, 700),  # crosses VECTORISE_FROM, where the scan switches to numpy
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 2**16),
)
def test_ngram_scan_equals_the_rule_at_every_length(vocab, length, k, max_n, seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab * 3) for _ in range(length)]
    min_n = rng.randint(1, max_n)
    d = NgramDrafter(num_speculative_tokens=k, prompt_lookup_max=max_n, prompt_lookup_min=min_n)
    assert d.propose_one(tokens) == ngram_reference(tokens, k, max_n, min_n)


def test_verify_greedy():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 4, 6, 8]):
        logits[i, t] = 5.0
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 6]  # two accepted, then the target's
    assert verify_greedy(logits, [3, 4, 6]) == [3, 4, 6, 8]  # all accepted + bonus


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_is_exact(deterministic):
    """Chi-square: the first emitted token is distributed as the target's p, whatever q is."""
    torch.manual_seed(0)
    v = 6
    p = torch.softmax(torch.randn(2, v), -1)
    q = torch.softmax(torch.randn(1, v) * 2, -1)
    gen = torch.Generator().manual_seed(1)
    n = 20000
    counts = Counter()
    for _ in range(n):
        if deterministic:  # an n-gram draft: always the same token (one-hot q)
            out = verify_sampled(p, None, [2], gen)
        else:
            d = int(torch.multinomial(q[0], 1, generator=gen))
            out = verify_sampled(p, q, [d], gen)
        counts[out[0]] += 1
    observed = torch.tensor([counts[i] for i in range(v)], dtype=torch.float64)
    expected = p[0].double() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom


def test_expected_tokens_formula_and_stats():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    s = SpecDecodeStats()
    s.record(3, 1)
    s.record(3, 3)
    d = s.as_dict()
    assert d["acceptance_rate"] == pytest.approx(4 / 6)
    assert d["mean_acceptance_length"] == pytest.approx(3.0)
    assert d["acceptance_rate_per_position"] == [1.0, 0.5, 0.5]


def test_acceptance_rate_and_prediction_with_variable_draft_lengths():
    """An n-gram drafter proposes fewer than k tokens when its match runs out: the per-token
    rate counts only the positions the verifier judged, and the prediction averages the
    formula over each verification's own k."""
    s = SpecDecodeStats()
    s.record(3, 3)  # judged 3, accepted 3
    s.record(2, 2)  # judged 2 (no third draft to judge), accepted 2
    s.record(3, 0)  # judged 1 (the first rejection ends it)
    a = 5 / 6
    assert s.conditional_acceptance_rate == pytest.approx(a)
    expected = (2 * expected_tokens_per_step(a, 3) + expected_tokens_per_step(a, 2)) / 3
    assert s.predicted_tokens_per_step == pytest.approx(expected)
    assert s.as_dict()["steps_by_num_drafts"] == {2: 1, 3: 2}
    # fixed-k drafts: the estimate is the usual accepted / reached
    fixed = SpecDecodeStats()
    for accepted in (0, 1, 2, 2):
        fixed.record(2, accepted)
    assert fixed.conditional_acceptance_rate == pytest.approx(5 / (1 + 2 + 2 + 2))


def test_prediction_by_draft_source_fits_a_mixture_of_rates():
    """A drafter mixing sources of different acceptance rates (n-gram matches of different
    lengths) breaks the formula's one-rate assumption for the pooled a; with each source at its
    own measured a, the prediction fits again. Drafts here are accepted independently: 4-gram
    matches at 0.95, 1-gram matches at 0.3, half of the verifications each, k = 5."""
    rng = random.Random(0)
    s = SpecDecodeStats()
    for step in range(20_000):
        source, a = ("4-gram", 0.95) if step % 2 else ("1-gram", 0.3)
        accepted = 0
        while accepted < 5 and rng.random() < a:
            accepted += 1
        s.record(5, accepted, source)
    measured = s.mean_acceptance_length
    expected = (expected_tokens_per_step(0.95, 5) + expected_tokens_per_step(0.3, 5)) / 2
    assert measured == pytest.approx(expected, rel=0.01)
    assert s.predicted_tokens_per_step_by_source == pytest.approx(measured, rel=0.01)
    assert s.predicted_tokens_per_step > 1.06 * measured  # the pooled a overestimates
    d = s.as_dict()
    assert d["sources"]["4-gram"]["conditional_acceptance_rate"] == pytest.approx(0.95, abs=0.01)
    assert d["sources"]["1-gram"]["num_spec_steps"] == 10_000
    # one source: both predictions are the same
    one = SpecDecodeStats()
    for accepted in (0, 3, 5, 2):
        one.record(5, accepted)
    assert list(one.by_source) == [ALL_DRAFTS]
    assert one.predicted_tokens_per_step_by_source == one.predicted_tokens_per_step


# ---- the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    return ids_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12)))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_is_exact(tiny_llama, draft_dir, reference, method, k):
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(draft_dir)
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              speculative_config=spec)  # fmt: skip
    assert ids_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12))) == reference
    assert ids_of(llm.generate({"prompt_token_ids": PROMPTS[3]}, greedy(12))) == [reference[3]]
    stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert llm.llm_engine.kv_usage() == 0
    # n-gram drafts are counted by the length of the match they continue
    sources = {ALL_DRAFTS} if method == "draft_model" else {"1-gram", "2-gram", "3-gram", "4-gram"}
    assert set(stats.by_source) <= sources
    assert sum(c.num_accepted_tokens for c in stats.by_source.values()) == stats.num_accepted_tokens


@pytest.mark.parametrize("draft", ["random", "self"])
def test_speculation_pauses_while_the_batch_is_large(tiny_llama, draft_dir, reference, draft):
    """disable_by_batch_size=3: while 3 or more requests run no step drafts; as they finish,
    drafting resumes, the draft model catching up on the tokens it skipped (a random draft,
    and the target as its own draft, whose drafts are all accepted). Same tokens."""
    model = str(draft_dir if draft == "random" else tiny_llama[0])
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3,
            "disable_by_batch_size": 3}  # fmt: skip
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              speculative_config=spec)  # fmt: skip
    drafted_at = []  # number of running requests at each step that drafted
    step = llm.llm_engine.step

    def counting_step():
        running = len(llm.llm_engine.scheduler.running)
        before = llm.llm_engine.spec_stats.num_spec_steps
        outs = step()
        if llm.llm_engine.spec_stats.num_spec_steps > before:
            drafted_at.append(running)
        return outs

    llm.llm_engine.step = counting_step
    # different lengths, so the batch shrinks while it runs
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert ids_of(outs) == [r[: 4 + 2 * i] for i, r in enumerate(reference)]
    assert drafted_at and max(drafted_at) < 3
    if draft == "self":
        assert llm.llm_engine.spec_stats.acceptance_rate == 1.0


def test_bad_disable_by_batch_size(tiny_llama):
    for bad in (0, -1, 2.5, True, "4"):
        spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": bad}
        with pytest.raises(ValueError, match="disable_by_batch_size must be an integer"):
            LLM(str(tiny_llama[0]), speculative_config=spec)


class RepeatLastDrafter(Drafter):
    """A drafter written outside the package: the last token, num_lookahead times."""

    def propose(self, entries, sampler):
        """One-hot drafts; each request's source named, as a drafter may."""
        self.draft_sources = {s.request.request_id: "repeat" for s in entries}
        return {s.request.request_id: [s.request.all_token_ids[-1]] * s.num_lookahead
                for s in entries}, {}  # fmt: skip


def test_a_drafter_from_outside_the_package(tiny_llama, reference):
    """speculative_config={"_target_": ...} builds a Drafter subclass the package never names;
    the outputs stay the target's, and its drafts are counted under the source it names. A
    _target_ that is no Drafter is refused before loading."""
    spec = {"_target_": f"{__name__}.RepeatLastDrafter", "num_speculative_tokens": 2}
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              speculative_config=spec)  # fmt: skip
    assert ids_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12))) == reference
    stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0 and set(stats.by_source) == {"repeat"}
    with pytest.raises(ValueError, match="must subclass paged_llm.spec.base.Drafter"):
        LLM(str(tiny_llama[0]), speculative_config={"_target_": "collections.Counter",
                                                    "num_speculative_tokens": 2})  # fmt: skip


def test_self_draft_accepts_everything(tiny_llama, reference):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_llama[0])}
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              speculative_config=spec)  # fmt: skip
    assert ids_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12))) == reference
    assert llm.llm_engine.spec_stats.acceptance_rate == 1.0


def test_a_draft_is_named_like_the_target():
    """The name 'tiny' gives the built-in default as a draft too (it was read as a directory)."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny"}
    llm = LLM("tiny", max_model_len=64, cpu_kv_cache_gib=0.01, speculative_config=spec)
    plain = LLM("tiny", max_model_len=64, cpu_kv_cache_gib=0.01)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ids_of(llm.generate(prompts, greedy(8))) == ids_of(plain.generate(prompts, greedy(8)))
    assert llm.llm_engine.spec_stats.acceptance_rate == 1.0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_preemption(tiny_llama, draft_dir, reference, mode, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(draft_dir)
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, num_gpu_blocks_override=40,
              preemption_mode=mode, swap_space=0.01, speculative_config=spec)  # fmt: skip
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    outs = ids_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], greedy(12)))
    assert outs == reference * 2
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_sampled_speculation_keeps_the_target_distribution(tmp_path):
    """Two-sample chi-square on a 6-token vocabulary: the second generated token's marginal is
    the same with and without a (poor) draft model."""
    target = save_llama(tmp_path / "t", vocab=6, hidden=32, layers=1, seed=0)
    draft = save_llama(tmp_path / "d", vocab=6, hidden=32, layers=1, seed=5)
    n = 600
    prompts = [{"prompt_token_ids": [1, 2, 3]}] * n
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=2, ignore_eos=True)
              for s in range(n)]  # fmt: skip
    kw = dict(block_size=4, max_model_len=32, cpu_kv_cache_gib=0.01)
    plain = Counter(o[1] for o in ids_of(LLM(str(target), **kw).generate(prompts, params)))
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)}
    llm = LLM(str(target), speculative_config=spec, **kw)
    params2 = [SamplingParams(temperature=1.0, seed=10_000 + s, max_tokens=2, ignore_eos=True)
               for s in range(n)]  # fmt: skip
    specd = Counter(o[1] for o in ids_of(llm.generate(prompts, params2)))
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    chi2 = 0.0
    for t in range(6):
        a, b = plain[t], specd[t]
        if a + b:
            chi2 += (a - b) ** 2 / (a + b)
    assert chi2 < 20.5  # 99.9% quantile, 5 degrees of freedom


SHAPED = dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=-0.3,
              logit_bias={40: 3.0})  # fmt: skip


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_is_exact_with_penalties_and_min_tokens(tiny_llama, draft_dir, method):
    """Verification scores draft i after drafts 0..i-1, so each row sees its own history:
    penalties count the drafts before it, and EOS is held back only until min_tokens."""
    kw = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(draft_dir)
    plain, specd = (
        LLM(str(tiny_llama[0]), **kw),
        LLM(str(tiny_llama[0]), speculative_config=spec, **kw),
    )
    eos = plain.llm_engine.eos_token_id
    cases = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **SHAPED),
        # EOS is the argmax from the first step on: the output stops right after min_tokens
        SamplingParams(temperature=0, max_tokens=12, min_tokens=5, logit_bias={eos: 100.0}),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for sp in cases:
        assert ids_of(specd.generate(prompts, sp)) == ids_of(plain.generate(prompts, sp))
    assert specd.llm_engine.spec_stats.num_draft_tokens > 0
    assert [len(t) for t in ids_of(plain.generate(prompts, cases[1]))] == [6] * len(PROMPTS)


def test_one_draft_step_mixing_plain_and_shaped_greedy_requests(tiny_llama, draft_dir):
    """Plain greedy drafts share one argmax per draft step (choose_draft_tokens); shaped ones
    (penalties, bias) beside them in the same step still get their own processing."""
    kw = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft_dir)}
    plain, specd = (
        LLM(str(tiny_llama[0]), **kw),
        LLM(str(tiny_llama[0]), speculative_config=spec, **kw),
    )
    shaped = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **SHAPED)
    params = [greedy(12) if i % 2 else shaped for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ids_of(specd.generate(prompts, params)) == ids_of(plain.generate(prompts, params))
    assert specd.llm_engine.spec_stats.num_accepted_tokens > 0


def test_self_draft_with_penalties_accepts_everything(tiny_llama):
    """The target as its own draft: every draft is accepted only if drafter and verifier both
    shape row i by the output plus drafts 0..i-1 (penalties, and EOS allowed from min_tokens)."""
    kw = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_llama[0])}
    plain, specd = (
        LLM(str(tiny_llama[0]), **kw),
        LLM(str(tiny_llama[0]), speculative_config=spec, **kw),
    )
    eos = plain.llm_engine.eos_token_id
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for sp in [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **SHAPED),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=2, logit_bias={eos: 100.0}),
    ]:
        assert ids_of(specd.generate(prompts, sp)) == ids_of(plain.generate(prompts, sp))
    stats = specd.llm_engine.spec_stats
    assert stats.num_accepted_tokens > 20 and stats.acceptance_rate == 1.0


def test_sampled_speculation_with_penalties_keeps_the_target_distribution(tmp_path):
    """As above, on the third token, whose distribution the penalties make depend on the
    first two (which verification may have accepted as drafts)."""
    target = save_llama(tmp_path / "t", vocab=6, hidden=32, layers=1, seed=0)
    draft = save_llama(tmp_path / "d", vocab=6, hidden=32, layers=1, seed=5)
    n = 600
    prompts = [{"prompt_token_ids": [1, 2, 3]}] * n
    shaped = dict(temperature=1.0, max_tokens=3, ignore_eos=True, repetition_penalty=2.0,
                  presence_penalty=1.0)  # fmt: skip
    kw = dict(block_size=4, max_model_len=32, cpu_kv_cache_gib=0.01)
    plain = LLM(str(target), **kw).generate(
        prompts, [SamplingParams(seed=s, **shaped) for s in range(n)]
    )
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)}
    llm = LLM(str(target), speculative_config=spec, **kw)
    specd = llm.generate(prompts, [SamplingParams(seed=10_000 + s, **shaped) for s in range(n)])
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    chi2 = 0.0
    a_counts = Counter(o[2] for o in ids_of(plain))
    b_counts = Counter(o[2] for o in ids_of(specd))
    for t in range(6):
        a, b = a_counts[t], b_counts[t]
        if a + b:
            chi2 += (a - b) ** 2 / (a + b)
    assert chi2 < 20.5  # 99.9% quantile, 5 degrees of freedom


def test_bad_speculative_config(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tiny_llama[0]), speculative_config={"method": "ngram"}, cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="unknown speculative method"):
        LLM(str(tiny_llama[0]), speculative_config={"method": "medusa",
            "num_speculative_tokens": 2}, cpu_kv_cache_gib=0.01)  # fmt: skip
    with pytest.raises(ValueError, match="'ngram' does not take these options.*'model'"):
        LLM(str(tiny_llama[0]), speculative_config={"method": "ngram", "model": "tiny",
            "num_speculative_tokens": 2}, cpu_kv_cache_gib=0.01)  # fmt: skip
    other = save_llama(tmp_path / "v", vocab=128)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01, speculative_config={
            "method": "draft_model", "num_speculative_tokens": 2, "model": str(other)})  # fmt: skip


@pytest.fixture(scope="module")
def engines(tiny_llama, draft_dir):
    kw = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft_dir)}
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    return [LLM(str(tiny_llama[0]), **kw), LLM(str(tiny_llama[0]), speculative_config=spec, **kw),
            LLM(str(tiny_llama[0]), speculative_config=ngram, **kw)]  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kw=st.fixed_dictionaries(
        {},
        optional={
            "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.5, 2.0),
            "logit_bias": st.dictionaries(st.integers(0, 255), st.floats(-10, 10), max_size=4),
            "allowed_token_ids": st.lists(st.integers(0, 255), min_size=2, max_size=40),
            "min_tokens": st.integers(0, 8),
            "ignore_eos": st.booleans(),
            "stop_token_ids": st.lists(st.integers(0, 255), max_size=2),
        },
    )
)
def test_greedy_speculation_is_exact_under_any_logits_processors(engines, kw):
    """Random penalty / bias / ban settings: both drafters give the plain engine's tokens."""
    sp = SamplingParams(temperature=0, max_tokens=10, **kw)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    plain, *specd = (ids_of(llm.generate(prompts, sp, use_tqdm=False)) for llm in engines)
    assert specd == [plain, plain]


@pytest.fixture(scope="module")
def mixed_engines(tiny_llama):
    """Engines that batch, chunk, cache, preempt and speculate differently."""
    kw = dict(block_size=4, max_model_len=64)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    return {
        "alone": LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01, **kw),
        "chunked+cached": LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01,
                              enable_chunked_prefill=True, max_num_batched_tokens=16,
                              enable_prefix_caching=True, **kw),
        "preempting+ngram": LLM(str(tiny_llama[0]), num_gpu_blocks_override=40,
                                speculative_config=ngram, **kw),
    }  # fmt: skip


_greedy_settings = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 12)},
    optional={
        "frequency_penalty": st.floats(-1, 2),
        "repetition_penalty": st.floats(0.7, 1.5),
        "logit_bias": st.dictionaries(st.integers(0, 255), st.floats(-5, 5), max_size=3),
        "min_tokens": st.integers(0, 4),
        "prompt_logprobs": st.integers(0, 2),
        "logprobs": st.integers(0, 3),
        "ignore_eos": st.booleans(),
    },
)


def assert_same_logprobs(want, got):
    """Two lists of logprob entries: the same tokens with the same ranks, values within 1e-4."""
    assert len(want) == len(got)
    for ea, eb in zip(want, got):
        assert ea.keys() == eb.keys()
        assert all(abs(ea[t] - eb[t]) < 1e-4 and ea[t].rank == eb[t].rank for t in ea)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(
        st.tuples(st.integers(0, len(PROMPTS) - 1), _greedy_settings), min_size=1, max_size=5
    ),
    engine=st.sampled_from(["chunked+cached", "preempting+ngram"]),
)
def test_each_request_of_a_mixed_batch_gets_what_it_gets_alone(mixed_engines, requests, engine):
    """Whatever else runs beside it (other settings, chunking, cache hits, preemption, drafts),
    a greedy request's tokens and prompt logprobs are those of running it alone."""
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    prompts = [{"prompt_token_ids": PROMPTS[i]} for i, _ in requests]
    params = [SamplingParams(temperature=0, **{**kw, "min_tokens": min(
        kw.get("min_tokens", 0), kw["max_tokens"])}) for _, kw in requests]  # fmt: skip
    alone = [mixed_engines["alone"].generate(p, sp, use_tqdm=False)[0]
             for p, sp in zip(prompts, params)]  # fmt: skip
    mixed = mixed_engines[engine].generate(prompts, params, use_tqdm=False)
    for a, m in zip(alone, mixed):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        if a.outputs[0].logprobs is not None:
            assert_same_logprobs(a.outputs[0].logprobs, m.outputs[0].logprobs)
        if a.prompt_logprobs is not None:
            for ea, em in zip(a.prompt_logprobs[1:], m.prompt_logprobs[1:]):
                assert ea.keys() == em.keys()
                assert all(abs(ea[t] - em[t]) < 1e-4 for t in ea)


@pytest.fixture(scope="module")
def self_draft(tiny_llama):
    """The target as its own draft model: every draft is accepted, so steps have k + 1 tokens."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_llama[0])}
    return LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
               speculative_config=spec)  # fmt: skip


@pytest.mark.parametrize("stop", [False, True])
def test_requests_with_logprobs_speculate_and_get_every_tokens_logprobs(engines, self_draft, stop):
    """Requests asking for logprobs (or ranking best_of) speculate too: a step's accepted
    drafts and its last token each get the logprobs a plain decode gives them, also when a stop
    token ends the step early; cumulative logprobs agree."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    if stop:  # a token the plain run generates mid-way, so some step stops among its drafts
        plain = engines[0].generate(prompts, base, use_tqdm=False)
        base = SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                              stop_token_ids=[plain[3].outputs[0].token_ids[5]])  # fmt: skip
    speculating = [engines[2], self_draft]  # n-grams, and a draft accepted in full
    plain, *specd = (llm.generate(prompts, base, use_tqdm=False)
                     for llm in [engines[0], *speculating])  # fmt: skip
    for llm in speculating:
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    for outs in specd:
        for a, b in zip(plain, outs):
            ca, cb = a.outputs[0], b.outputs[0]
            assert cb.token_ids == ca.token_ids and len(cb.logprobs) == len(cb.token_ids)
            assert_same_logprobs(ca.logprobs, cb.logprobs)
            assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)
    if stop:
        assert any(o.outputs[0].finish_reason == "stop" for o in plain)


def test_sampled_logprobs_under_speculation_are_the_models(tiny_llama, self_draft):
    """With sampling, each returned logprob of a chosen token is the target's log-softmax at
    that position (transformers on prompt + output), for accepted drafts and bonus tokens."""
    llm = self_draft
    sp = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, logprobs=0, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    for prompt, out in zip(PROMPTS, outs):
        ids = out.outputs[0].token_ids
        with torch.no_grad():
            logits = tiny_llama[1](torch.tensor([prompt + ids])).logits[0].float()
        want = logits[len(prompt) - 1 : -1].log_softmax(-1)  # [len(ids), V]
        got = out.outputs[0].logprobs
        assert [list(e) for e in got] == [[t] for t in ids]  # logprobs=0: the chosen token only
        assert [e[t] for e, t in zip(got, ids)] == pytest.approx(
            [float(want[i, t]) for i, t in enumerate(ids)], abs=1e-4
        )


def test_greedy_speculation_is_exact_with_user_logits_processors(engines):
    """A user processor that depends on the history (no token twice in a row) is called on
    each verified row with the drafts before it, so both drafters keep the plain tokens."""

    def no_repeat(output_ids, logits):
        if output_ids:
            logits[output_ids[-1]] = float("-inf")
        return logits

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                        logits_processors=[no_repeat])  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    before = [llm.llm_engine.spec_stats.num_draft_tokens for llm in engines[1:]]
    plain, *specd = (ids_of(llm.generate(prompts, sp, use_tqdm=False)) for llm in engines)
    assert specd == [plain, plain]
    assert plain != ids_of(engines[0].generate(prompts, greedy(12), use_tqdm=False))
    after = [llm.llm_engine.spec_stats.num_draft_tokens for llm in engines[1:]]
    assert all(a > b for a, b in zip(after, before))  # both drafters did propose


def test_an_aborted_request_leaves_no_draft_state_behind(tiny_llama):
    """The draft model remembers how much of each request it has computed; an abort must
    clear that too, or a later request with the same id (LLM.generate reuses its ids) would
    draft from another request's KV: still exact, but accepting less. With the target as its
    own draft every draft is accepted, so any stale state shows."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_llama[0])}
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              speculative_config=spec)  # fmt: skip
    engine = llm.llm_engine
    stats = engine.spec_stats

    def accepted_running(prompt):
        before = stats.num_accepted_tokens
        engine.add_request("x", {"prompt_token_ids": prompt}, greedy(12))
        while engine.has_unfinished_requests():
            engine.step()
        return stats.num_accepted_tokens - before

    fresh = accepted_running(PROMPTS[4])
    other = [(7 * i + 100) % 250 for i in range(30)]  # a different prompt, a longer one
    engine.add_request("x", {"prompt_token_ids": other}, greedy(30))
    for _ in range(3):  # prefill, then two steps that draft
        engine.step()
    engine.abort_request("x")
    assert fresh > 0 and accepted_running(PROMPTS[4]) == fresh


def test_ngram_scan_benchmark_writes_json(tmp_path):
    from experiments import ngram_scan
    from paper_repro.common import compose

    cfg = compose("ngram_scan", ["lengths=[8,400]", "calls=2", "repeats=1"])
    doc = ngram_scan.write(cfg, tmp_path)
    assert (tmp_path / "ngram_scan.json").is_file() and doc["run_info"]["mode"] == "real"
    assert {(r["tokens"], r["context"]) for r in doc["rows"]} == {
        (t, n) for t in ("no_match", "vocab_16") for n in (8, 400)
    }
    assert all(r["python_us"] > 0 and r["numpy_us"] > 0 for r in doc["rows"])
