"""LLM.get_metrics: vLLM's reader types over the server's metrics, and the parser behind it."""

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.metrics.reader import Counter, Gauge, Histogram, Vector, parse_metrics_text
from paged_llm.outputs import RequestMetrics
from paged_llm.serve.metrics import EngineGauges, ServerMetrics, SpecDecodeCounts

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 2) for i in range(4)]


def by_name(metrics):
    out = {}
    for m in metrics:
        out.setdefault(m.name, []).append(m)
    return out


def test_parser_reads_counters_gauges_histograms_and_the_per_position_vector():
    sm = ServerMetrics('odd "model" \\ name')
    sm.record_tokens(7, 3)
    sm.record_finish_reason("length")
    sm.record_latencies(RequestMetrics(arrival_time=0.0, first_scheduled_time=0.002,
                                       first_token_time=0.03, token_times=[0.03, 0.05, 0.2],
                                       finished_time=0.2))  # fmt: skip
    gauges = EngineGauges(running=2, kv_usage=0.25, preemptions=4,
                          spec_decode=SpecDecodeCounts(5, 12, 7, (4, 2, 1)))  # fmt: skip
    got = by_name(parse_metrics_text(sm.render(gauges)))
    label = {"model_name": 'odd "model" \\ name'}
    assert got["vllm:num_requests_running"] == [Gauge("vllm:num_requests_running", label, 2.0)]
    assert got["vllm:kv_cache_usage_perc"][0].value == 0.25
    # counters are named without _total, as prometheus_client names their families
    assert got["vllm:num_preemptions"] == [Counter("vllm:num_preemptions", label, 4)]
    assert got["vllm:prompt_tokens"][0].value == 7 and got["vllm:generation_tokens"][0].value == 3
    success = {m.labels["finished_reason"]: m.value for m in got["vllm:request_success"]}
    assert success == {"stop": 0, "length": 1, "abort": 0}
    assert got["vllm:spec_decode_num_drafts"][0].value == 5
    assert got["vllm:spec_decode_num_accepted_tokens_per_pos"] == [
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", label, [4, 2, 1])
    ]
    (tpot,) = got["vllm:time_per_output_token_seconds"]
    assert isinstance(tpot, Histogram) and tpot.labels == label
    assert tpot.count == 2 and tpot.sum == pytest.approx(0.17)
    assert tpot.buckets["+Inf"] == 2 and tpot.buckets["0.025"] == 1  # cumulative: 0.02 <= 0.025
    assert list(tpot.buckets.values()) == sorted(tpot.buckets.values())


def test_parser_rejects_a_line_that_is_not_a_sample():
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        parse_metrics_text('# TYPE vllm:x gauge\nvllm:x{a="1"}\n')


def test_get_metrics_counts_what_the_engine_did(tiny_llama):
    """vLLM's offline spec-decode example reads acceptance this way; the numbers equal the
    engine's own counters and the outputs."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama[0]), block_size=4, max_model_len=64, speculative_config=spec,
              disable_log_stats=False)  # fmt: skip
    assert llm.llm_engine.config.log_stats  # vLLM's name for it, inverted
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = by_name(llm.get_metrics())
    stats = llm.llm_engine.spec_stats
    drafts = got["vllm:spec_decode_num_drafts"][0].value
    accepted = got["vllm:spec_decode_num_accepted_tokens"][0].value
    assert drafts == stats.num_spec_steps > 0 and accepted == stats.num_accepted_tokens
    assert got["vllm:spec_decode_num_draft_tokens"][0].value == stats.num_draft_tokens
    assert 1 + accepted / drafts == pytest.approx(stats.mean_acceptance_length)
    per_pos = got["vllm:spec_decode_num_accepted_tokens_per_pos"][0].values
    assert per_pos == stats.accepted_per_position and sum(per_pos) == accepted
    assert got["vllm:prompt_tokens"][0].value == sum(len(p) for p in PROMPTS)  # once per prompt
    assert got["vllm:generation_tokens"][0].value == sum(
        len(c.token_ids) for o in outs for c in o.outputs
    )
    success = {m.labels["finished_reason"]: m.value for m in got["vllm:request_success"]}
    assert success["length"] == 2 * len(PROMPTS)
    assert got["vllm:e2e_request_latency_seconds"][0].count == len(PROMPTS)
    assert got["vllm:num_requests_running"][0].value == 0
