"""The batched top-k / top-p / min-p mask equals the plain per-row reference, whichever path it
takes (a row's nucleus found among its most likely tokens, or the whole row sorted)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm.runner import top_k_top_p
from paged_llm.runner.top_k_top_p import apply_top_k_top_p_min_p, mask_rows


def logits_rows(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """Rows from flat to peaked (log-Zipf like a trained model's), some with banned tokens."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1).float().log()
    out = []
    for i in range(rows):
        slope = [0.0, 0.5, 1.5, 3.0][i % 4]
        perm = torch.randperm(vocab, generator=gen)
        row = -slope * ranks[perm] + torch.randn(vocab, generator=gen)
        if i % 3 == 0:  # a logits processor or grammar banned some tokens
            row[torch.randperm(vocab, generator=gen)[: vocab // 3]] = float("-inf")
        out.append(row)
    return torch.stack(out)


@pytest.mark.parametrize("may_wait", [True, False])  # False: nucleus rows sorted whole
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 10**6),
    vocab=st.sampled_from([1, 2, 37, 300]),
    candidates=st.sampled_from([1, 4, 16, 256]),
    settings_=st.lists(
        st.tuples(
            st.sampled_from([-1, 0, 1, 2, 5, 40, 300, 400]),
            st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-30]),
            st.sampled_from([0.0, 0.05, 0.5]),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_mask_rows_equals_the_per_row_reference(seed, vocab, candidates, settings_, may_wait):
    logits = logits_rows(seed, len(settings_), vocab)
    top_k, top_p, min_p = (list(column) for column in zip(*settings_))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(top_k_top_p, "NUCLEUS_CANDIDATES", candidates)
        got = mask_rows(logits, top_k, top_p, min_p, may_wait)
    for row, (k, p, m) in zip(range(len(settings_)), settings_):
        want = apply_top_k_top_p_min_p(logits[row], k, p, m)
        assert torch.equal(got[row] == float("-inf"), want == float("-inf")), (k, p, m)
        kept = want > float("-inf")
        assert torch.equal(got[row][kept], want[kept])
        assert bool(kept.any())  # the most likely token always stays


def test_a_peaked_nucleus_is_found_among_the_candidates(monkeypatch):
    """Trained models' nuclei fit the candidates, so no row is sorted whole."""
    logits = logits_rows(0, 8, 5000)[2::4]  # the two peaked rows (slope 3)
    calls, topk = [], torch.topk
    monkeypatch.setattr(torch, "topk", lambda x, k: calls.append(k) or topk(x, k))
    keep = mask_rows(logits, [-1, -1], [0.9, 0.9], [0.0, 0.0])
    assert calls == [top_k_top_p.NUCLEUS_CANDIDATES]
    for row, got in zip(logits, keep):
        want = apply_top_k_top_p_min_p(row, -1, 0.9, 0.0)
        assert torch.equal(got == float("-inf"), want == float("-inf"))


def test_sampler_mask_experiment_writes_its_json(tmp_path):
    from experiments.sampler_mask import main

    result = main(["--vocab", "600", "--rows", "4", "--repeats", "1", "--out", str(tmp_path)])
    assert (tmp_path / "sampler_mask.json").exists() and result["mode"] == "real"
    assert len(result["results"]) == 6 and all(r["same_tokens"] for r in result["results"])


def test_draws_follow_the_masked_distribution():
    """Chi-square: 4,000 draws (one row per request, each with its own generator) land on
    tokens as softmax(logits / T) masked by top-p says, and never on a masked token."""
    from paged_llm.core.request import Request
    from paged_llm.runner.sampler import Sampler
    from paged_llm.runner.top_k_top_p import sampling_probs
    from paged_llm.sampling_params import SamplingParams

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0, float("-inf")])
    params = SamplingParams(temperature=0.7, top_p=0.95)
    probs = sampling_probs(logits[None], [params])[0]
    sampler, counts = Sampler(seed=0), torch.zeros(len(logits))
    for batch in range(40):
        requests = [Request(f"r{batch}-{i}", [1], params) for i in range(100)]
        for result in sampler(logits.expand(100, -1).clone(), requests):
            counts[result.token_id] += 1
    kept = probs > 0
    assert counts[~kept].sum() == 0 and int(kept.sum()) < len(logits) - 1  # top-p cut a token
    expected = 4000 * probs[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    quantile = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[int(kept.sum()) - 1]  # 99.9%
    assert chi2 < quantile


def test_random_sampling_stays_on_the_logits_device(monkeypatch):
    """Drawing tokens keeps the [N, V] rows where the logits are (on a GPU: no copy of the
    vocabulary-wide rows to the host, no CPU softmax); only the chosen ids come back, in one
    ``tolist``. Seeded requests still draw the same tokens, whatever else shares the batch."""
    from paged_llm.core.request import Request
    from paged_llm.runner.sampler import Sampler
    from paged_llm.sampling_params import SamplingParams

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)).expand(6, -1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=1.2, top_k=5, seed=4)] * 2  # fmt: skip
    requests = [Request(f"r{i}", [1], p) for i, p in enumerate(params)]

    def no_host_copy(self, *args, **kwargs):
        raise AssertionError("the sampler copied a tensor to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", no_host_copy)
    results = Sampler(seed=0)(logits.clone(), requests)
    monkeypatch.undo()
    assert results[0].token_id == results[3].token_id == int(logits[0].argmax())
    assert [r.token_id for r in results[1:3]] == [r.token_id for r in results[4:6]]  # same seeds
    alone = Sampler(seed=1)(logits[1:3].clone(), requests[1:3])  # other rows, other engine seed
    assert [r.token_id for r in alone] == [r.token_id for r in results[1:3]]


# settings mixes of a batch: greedy, temperature only, top-k, top-p, min-p, with logprobs
NO_WAIT_BATCHES = {
    "temperature": [{"temperature": 0.8}],
    "greedy_and_temperature": [{"temperature": 0.0}, {"temperature": 1.3}],
    "top_k": [{"top_k": 50}, {"top_k": 900}],
    "top_p": [{"top_p": 0.9}, {"top_p": 0.5, "top_k": 20}, {"temperature": 0.0}],
    "min_p": [{"min_p": 0.1}, {"temperature": 0.7}],
    "logprobs": [{"top_p": 0.95, "logprobs": 3}, {"temperature": 0.0, "logprobs": 0}],
    # logits processing that needs only the count of outputs (async scheduling defers it)
    "min_tokens_and_bias": [
        {"min_tokens": 5, "stop_token_ids": [3]},
        {"logit_bias": {5: 2.0, 9: -100.0}, "temperature": 0.7},
    ],
    "allowed_and_bad_words": [
        {"allowed_token_ids": [2, 3], "min_tokens": 4, "top_p": 0.8},
        {"bad_words": ["x"], "temperature": 0.0},
    ],
    # penalties count the last output's token while it is still on the device
    "penalties": [
        {"repetition_penalty": 1.3, "frequency_penalty": 0.5},
        {"presence_penalty": 1.0, "temperature": 0.0, "min_tokens": 9},
    ],
}


@pytest.mark.parametrize("batch", NO_WAIT_BATCHES.values(), ids=NO_WAIT_BATCHES)
def test_sampling_that_may_not_wait_reads_nothing_from_the_device(monkeypatch, batch):
    """Async scheduling samples step N + 1 while its forward runs: a read of a device value
    (``bool(t.any())``, ``.item()``, a ``nonzero``) would stall the host for that whole forward
    on a GPU. Tensors on the meta device have no values, so any such read fails there."""
    from paged_llm.core.request import PLACEHOLDER_TOKEN, Request
    from paged_llm.runner.async_tokens import DeferredTokens
    from paged_llm.runner.sampler import Sampler, has_constraints
    from paged_llm.sampling_params import SamplingParams

    vocab = 1000  # wide enough for the candidates path (2 * 256 < vocab)
    requests = [Request(f"r{i}", [1, 2], SamplingParams(**kw), eos_token_id=2,
                        output_token_ids=[5, 8, PLACEHOLDER_TOKEN],  # the last one pending
                        bad_words_token_ids=[[7], [8, 4, 9]] if kw.get("bad_words") else [])
                for i, kw in enumerate(batch * 2)]  # fmt: skip
    s = Sampler()
    monkeypatch.setattr(s, "generator", lambda *args: None)  # the meta device has no generator
    logits = torch.empty(len(requests), vocab, device="meta")
    previous = torch.empty(len(requests), dtype=torch.int64, device="meta")  # step N's ids
    pending = {r.request_id: previous[i : i + 1] for i, r in enumerate(requests)}.__getitem__
    ids = s.sample_ids(logits, requests, may_wait=False, pending=pending)
    assert ids.shape == (len(requests),) and ids.device.type == "meta"
    DeferredTokens.start(requests, ids, logits)  # the logprobs packed for the same copy
    waits = any(r.sampling_params.top_p < 1.0 or has_constraints(r, r.num_output_tokens)
                for r in requests)  # fmt: skip
    if waits:  # the check above does detect the waits of the path that may wait
        with pytest.raises(RuntimeError, match="meta"):
            s.sample_ids(logits, requests, may_wait=True, pending=pending)


class _FixedGuide:
    """A grammar stand-in that allows the same tokens at every position."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.mask = allowed

    def allowed(self, tokens) -> torch.Tensor:  # [V] bool
        return self.mask


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 10**6),
    min_tokens=st.integers(0, 4),
    outputs=st.lists(st.integers(0, 11), max_size=5),
    allowed=st.none() | st.sets(st.integers(0, 11), min_size=1, max_size=3).map(sorted),
    bias=st.none() | st.dictionaries(st.integers(0, 11), st.floats(-100, 100), max_size=3),
    bad_word=st.none() | st.integers(0, 11),
    grammar=st.none() | st.sets(st.integers(0, 11), min_size=1, max_size=4).map(sorted),
)
def test_processing_that_may_not_wait_changes_the_rows_alike(
    seed, min_tokens, outputs, allowed, bias, bad_word, grammar
):
    """``process_request_rows`` without waiting applies the weaker constraints by
    ``torch.where`` unasked; every row must come out as the waiting path makes it, including
    rows whose bans, whitelists and grammar leave no token."""
    from paged_llm.core.request import Request
    from paged_llm.runner.logits_processors import process_request_rows
    from paged_llm.sampling_params import SamplingParams

    vocab = 12
    words = [] if bad_word is None else [[bad_word]]
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=[3], allowed_token_ids=allowed,
                            logit_bias=bias, bad_words=["w"] if words else None)  # fmt: skip
    request = Request("r", [1, 2], params, eos_token_id=2, output_token_ids=list(outputs),
                      bad_words_token_ids=words)  # fmt: skip
    if grammar is not None:
        request.guide = _FixedGuide(torch.isin(torch.arange(vocab), torch.tensor(grammar)))
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(seed))  # finite
    histories = [list(outputs), list(outputs) + [5]]
    waited = process_request_rows(logits.clone(), request, histories, may_wait=True)
    unasked = process_request_rows(logits.clone(), request, histories, may_wait=False)
    assert torch.equal(waited, unasked)
    assert bool(torch.isfinite(unasked).any(-1).all())  # every row keeps a token
