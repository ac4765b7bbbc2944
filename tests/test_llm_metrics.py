"""LLM.get_metrics and the server's /metrics: one table of metric families (vLLM's names),
rendered as vLLM's reader types and, through prometheus_client, as Prometheus text."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from paged_llm import LLM, SamplingParams
from paged_llm.core.kv.base import KVCacheStats
from paged_llm.metrics.reader import Counter, Gauge, Histogram, Vector, from_families
from paged_llm.outputs import RequestMetrics
from paged_llm.serve.metrics import EngineGauges, ServerMetrics, SpecDecodeCounts, parse_metrics

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 2) for i in range(4)]
ODD_NAME = 'odd "model" \\ name'


def by_name(metrics):
    out = {}
    for m in metrics:
        out.setdefault(m.name, []).append(m)
    return out


def busy_metrics():
    """Counters after one finished request, and gauges with every optional family on."""
    sm = ServerMetrics(ODD_NAME)
    sm.record_tokens(7, 3)
    sm.record_finish_reason("length")
    sm.record_latencies(RequestMetrics(arrival_time=0.0, first_scheduled_time=0.002,
                                       first_token_time=0.03, token_times=[0.03, 0.05, 0.2],
                                       finished_time=0.2))  # fmt: skip
    gauges = EngineGauges(running=2, kv_usage=0.25, preemptions=4,
                          prefix_cache=KVCacheStats(True, 10, 6, offload=(3, 1)),
                          spec_decode=SpecDecodeCounts(5, 12, 7, (4, 2, 1)))  # fmt: skip
    return sm, gauges


def test_get_metrics_types_read_counters_gauges_histograms_and_the_per_position_vector():
    sm, gauges = busy_metrics()
    got = by_name(from_families(sm.families(gauges)))
    label = {"model_name": ODD_NAME}
    assert got["vllm:num_requests_running"] == [Gauge("vllm:num_requests_running", label, 2.0)]
    assert got["vllm:kv_cache_usage_perc"][0].value == 0.25
    # counters are named without _total, as prometheus_client names their families
    assert got["vllm:num_preemptions"] == [Counter("vllm:num_preemptions", label, 4)]
    assert got["vllm:prompt_tokens"][0].value == 7 and got["vllm:generation_tokens"][0].value == 3
    success = {m.labels["finished_reason"]: m.value for m in got["vllm:request_success"]}
    assert success == {"stop": 0, "length": 1, "abort": 0}
    assert got["vllm:spec_decode_num_drafts"][0].value == 5
    assert got["vllm:prefix_cache_hits"][0].value == 6
    assert got["paged_llm:kv_offload_saved_blocks"][0].value == 3
    assert got["vllm:spec_decode_num_accepted_tokens_per_pos"] == [
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", label, [4, 2, 1])
    ]
    (tpot,) = got["vllm:time_per_output_token_seconds"]
    assert isinstance(tpot, Histogram) and tpot.labels == label
    assert tpot.count == 2 and tpot.sum == pytest.approx(0.17)
    assert tpot.buckets["+Inf"] == 2 and tpot.buckets["0.025"] == 1  # cumulative: 0.02 <= 0.025
    assert list(tpot.buckets.values()) == sorted(tpot.buckets.values())


def test_the_server_text_says_what_get_metrics_says():
    """prometheus_client's own parser reads the exposition back to the same families, values
    and labels (an odd model name included) as the reader types."""
    sm, gauges = busy_metrics()
    text = sm.render(gauges)
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    for m in from_families(sm.families(gauges)):
        family = parsed[m.name]
        if isinstance(m, Histogram):
            assert family.type == "histogram"
            samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
            assert samples[(m.name + "_count", None)] == m.count
            assert samples[(m.name + "_sum", None)] == pytest.approx(m.sum)
            assert all(samples[(m.name + "_bucket", le)] == n for le, n in m.buckets.items())
        elif isinstance(m, Vector):
            got = {int(s.labels["position"]): s.value for s in family.samples}
            assert [got[i] for i in range(len(m.values))] == m.values
        else:
            (sample,) = [s for s in family.samples if s.labels == m.labels]
            kind = "gauge" if isinstance(m, Gauge) else "counter"
            suffix = "_total" if kind == "counter" else ""
            assert family.type == kind and sample.name == m.name + suffix
            assert sample.value == m.value
    flat = parse_metrics(text)
    assert flat['vllm:num_requests_running{model_name="odd \\"model\\" \\\\ name"}'] == 2


def test_features_that_are_off_export_nothing():
    """No prefix-cache, speculative or LoRA families without the feature: zeros would mislead."""
    names = {m.name for m in from_families(ServerMetrics("m").families(EngineGauges()))}
    assert "vllm:num_requests_running" in names and "vllm:engine_sleep_state" in names
    assert not {n for n in names if "prefix_cache" in n or "spec_decode" in n or "lora" in n}


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
