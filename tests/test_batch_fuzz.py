"""Random mixes of every sampling option in one batch (grammars, whitelists, bans, penalties,
stops, logprobs, n, best_of, truncation, user logits processors), on engines that chunk, cache
prefixes, speculate and preempt: a request is either refused when added (ValueError) or
finishes, and never fails the batch it runs in. (A grammar that excluded every allowed token
once stopped the engine this way.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_llm import LLM, GuidedDecodingParams, SamplingParams

ENGINES = {
    "chunked+prefix": dict(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=16,
                           enable_prefix_caching=True, cpu_kv_cache_gib=0.02),
    "ngram+swap": dict(block_size=4, num_gpu_blocks_override=24, max_model_len=96,
                       preemption_mode="swap",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}  # fmt: skip
GRAMMARS = [
    GuidedDecodingParams(regex="[ab]{2}"),
    GuidedDecodingParams(choice=["yes", "no"]),
    GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    GuidedDecodingParams(grammar='root ::= "x" [0-9]'),
]
PROMPTS = ["def f(x):", "import os\n", "a", "class A:\n    x = 1"]
VOCAB = 512  # ids beyond the tiny model's vocabulary are refused, which is part of the test


def _no_repeat(output_ids, logits):
    if output_ids:
        logits[output_ids[-1]] = float("-inf")
    return logits


def _favour_a(prompt_ids, output_ids, logits):
    logits[prompt_ids[0]] += 5.0
    return logits


_params = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 10)},
    optional={
        "n": st.integers(1, 3),
        "best_of": st.integers(1, 4),
        "temperature": st.sampled_from([0.0, 1e-6, 0.7, 1.0, 50.0]),
        "top_p": st.sampled_from([1.0, 0.5, 1e-6]),
        "top_k": st.sampled_from([-1, 1, 5]),
        "min_p": st.sampled_from([0.0, 0.5, 1.0]),
        "min_tokens": st.integers(0, 3),
        "seed": st.integers(0, 5),
        "presence_penalty": st.sampled_from([2.0, -2.0]),
        "repetition_penalty": st.sampled_from([1e-3, 50.0]),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB), st.sampled_from([-100.0, 100.0]),
                                      max_size=3),
        "allowed_token_ids": st.lists(st.integers(0, VOCAB), min_size=1, max_size=3),
        "bad_words": st.lists(st.sampled_from(["a", "def", " x", "\n"]), max_size=2),
        "stop": st.lists(st.sampled_from(["a", "\n", "):"]), max_size=2),
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, 3),
        "prompt_logprobs": st.integers(0, 2),
        "truncate_prompt_tokens": st.integers(1, 5),
        "guided_decoding": st.sampled_from(GRAMMARS),
        "logits_processors": st.sampled_from([[_no_repeat], [_favour_a]]),
        "detokenize": st.booleans(),
    },
)  # fmt: skip


@pytest.fixture(scope="module", params=list(ENGINES))
def llm(request):
    return LLM("tiny", **ENGINES[request.param])


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(_params, min_size=1, max_size=4))
def test_a_batch_of_random_requests_finishes(llm, batch):
    accepted = []
    for prompt, kw in zip(PROMPTS, batch):
        try:
            params = SamplingParams(**kw)
            llm.generate(prompt, params, use_tqdm=False)  # alone first: refused or finishes
        except ValueError:
            continue
        accepted.append((prompt, params))
    if accepted:
        outs = llm.generate([p for p, _ in accepted], [s for _, s in accepted], use_tqdm=False)
        for out, (_, params) in zip(outs, accepted):
            assert out.finished and len(out.outputs) == params.n
            assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_usage() == 0  # no block leaked
