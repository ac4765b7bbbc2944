"""SamplingParams(prompt_logprobs=k): every prompt token's logprob under the model, as
transformers computes it, through chunked prefill, prefix caching, preemption and n > 1."""

import logging

import pytest
import torch

from paged_llm import LLM, SamplingParams

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(4)] + [[7]]  # lengths 5..20 and 1


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Per prompt: [P - 1, V] log-softmax of transformers' logits (row i scores token i + 1)."""
    model = tiny_llama[1]
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, :-1].log_softmax(-1) for p in PROMPTS]


def check(outs, reference, top_k, prompts=PROMPTS):
    for prompt, out, ref in zip(prompts, outs, reference):
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for i in range(1, len(prompt)):
            entry, row = lps[i], ref[i - 1]
            assert entry[prompt[i]] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
            top = torch.topk(row, top_k).indices.tolist()
            assert set(entry) == set(top) | {prompt[i]}
            for t in top:
                assert entry[t] == pytest.approx(row[t].item(), abs=1e-4)
            for t, lp in entry.items():  # vLLM's Logprob: rank 1 = the most likely token
                assert lp.logprob == float(lp) and lp.rank == int((row > row[t]).sum()) + 1


def run(llm, top_k, **kw):
    kw = {"temperature": 0, "max_tokens": 4, "ignore_eos": True, **kw}
    sp = SamplingParams(prompt_logprobs=top_k, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)


@pytest.mark.parametrize(
    "engine_kw",
    [
        {"block_size": 16},
        {"block_size": 4, "enable_chunked_prefill": True, "max_num_batched_tokens": 6},
    ],
)
@pytest.mark.parametrize("top_k", [0, 3])
def test_matches_transformers(tiny_llama, reference, engine_kw, top_k):
    llm = LLM(str(tiny_llama[0]), max_model_len=64, cpu_kv_cache_gib=0.01, **engine_kw)
    check(run(llm, top_k), reference, top_k)


def test_only_the_entries_come_to_the_host(tiny_llama, reference, monkeypatch):
    """The [P, V] log-probability rows stay where the logits are (on a GPU a long prompt's rows
    are hundreds of MB); one flat tensor of the entries is copied back, with mixed top-k."""
    llm = LLM(str(tiny_llama[0]), max_model_len=64, cpu_kv_cache_gib=0.01)
    copied, real_cpu = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copied.append(t.dim()) or
                        real_cpu(t, *a, **k))  # fmt: skip
    kw = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(prompt_logprobs=k, **kw) for k in (0, 3, 3, 1, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert copied and set(copied) == {1}  # flat packed entries only
    for i, k in enumerate((0, 3, 3, 1, 2)):  # rows of one batch with different k stay right
        check(outs[i : i + 1], reference[i : i + 1], k, PROMPTS[i : i + 1])


def test_requests_without_it_get_none(tiny_llama):
    llm = LLM(str(tiny_llama[0]), max_model_len=64, cpu_kv_cache_gib=0.01)
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=2))[0]
    assert out.prompt_logprobs is None


def test_prefix_cache_is_bypassed_so_every_token_is_scored(tiny_llama, reference):
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01,
              enable_prefix_caching=True)  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain, use_tqdm=False)
    kv = llm.llm_engine.scheduler.kv
    hits = kv.prefix_hits
    check(run(llm, 1), reference, 1)  # the prompts are all cached by now
    assert kv.prefix_hits == hits
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], plain, use_tqdm=False)
    assert kv.prefix_hits > hits  # plain requests still use the cache


def test_with_preemption_and_parallel_samples(tiny_llama, reference):
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, num_gpu_blocks_override=24,
              preemption_mode="recompute")  # fmt: skip
    logging.getLogger("paged_llm.core.scheduler").setLevel(logging.ERROR)
    outs = run(llm, 2, n=2, temperature=1.0, seed=0, max_tokens=24)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert all(len(o.outputs) == 2 for o in outs)
    check(outs, reference, 2)


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_bad_values_raise(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
