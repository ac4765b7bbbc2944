"""Arrivals, workload building and trace formats (plain Python, fast)."""

import json
import math
import pickle
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.workloads.arrivals import (
    TimedRequest,
    WorkloadSpec,
    arrival_times,
    arrivals_within,
    build_workload,
    prompt_token_ids,
)
from paged_llm.workloads.lengths import LengthPair
from paged_llm.workloads.traces import (
    ALPACA,
    SHAREGPT_TRACE,
    length_source,
    load_artifact_pickle,
    load_sharegpt_json,
    load_trace,
    scale_lengths,
)


def test_poisson_mean_gap_and_seed():
    times = arrival_times(20000, request_rate=4.0, seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)
    assert times == arrival_times(20000, 4.0, seed=1)
    assert times != arrival_times(20000, 4.0, seed=2)
    assert all(b >= a for a, b in zip(times, times[1:]))


def test_gamma_burstiness_keeps_rate_and_sets_cv():
    times = arrival_times(20000, request_rate=2.0, seed=0, burstiness=0.25)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.1)


def test_arrivals_within_duration_and_infinite_rate():
    times = arrivals_within(1000.0, 3.0, seed=0)
    assert all(0 <= t < 1000.0 for t in times)
    assert len(times) == pytest.approx(3000, rel=0.05)
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, 0.0, seed=0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, seed=0, burstiness=0)


def test_synthetic_workload_is_labelled_and_filtered():
    w = build_workload(WorkloadSpec(request_rate=10.0, duration_s=100.0, seed=3))
    assert w.synthetic and w.source.startswith("synthetic:sharegpt")
    assert w.describe()["synthetic"] is True
    assert all(r.input_len + r.output_len < 2048 and r.input_len >= 1 for r in w.requests)
    assert [r.arrival_time for r in w.requests] == sorted(r.arrival_time for r in w.requests)
    again = build_workload(WorkloadSpec(request_rate=10.0, duration_s=100.0, seed=3))
    assert again.requests == w.requests


def test_alpaca_synthetic_matches_paper_means():
    src = length_source(None, "alpaca", pool_size=20000, seed=0)
    assert src.synthetic and "alpaca" in src.label
    assert statistics.mean(p.input_len for p in src.pairs) == pytest.approx(
        ALPACA.input_mean, rel=0.05
    )
    assert statistics.mean(p.output_len for p in src.pairs) == pytest.approx(
        ALPACA.output_mean, rel=0.05
    )


def test_csv_trace_and_filter(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("input_len,output_len\n10,20\n2000,100\n5,1\n0,4\n")
    w = build_workload(
        {"path": str(path), "request_rate": 100.0, "num_requests": 50, "duration_s": None}
    )
    assert not w.synthetic and w.source == f"trace:{path}"
    assert {(r.input_len, r.output_len) for r in w.requests} <= {(10, 20), (5, 1)}
    with pytest.raises(FileNotFoundError, match="workload.path=null"):
        build_workload({"path": str(tmp_path / "missing.csv")})


def test_shipped_sharegpt_trace_means():
    """The shipped trace after the paper's filter: the row count and means its README states."""
    src = length_source(SHAREGPT_TRACE)
    assert not src.synthetic and src.label == f"trace:{SHAREGPT_TRACE}"
    assert len(src.pairs) == 79725
    assert statistics.mean(p.input_len for p in src.pairs) == pytest.approx(161.18, abs=0.01)
    assert statistics.mean(p.output_len for p in src.pairs) == pytest.approx(338.00, abs=0.01)


def test_artifact_pickle_loads_plain_pairs(tmp_path):
    path = tmp_path / "lengths.pkl"
    path.write_bytes(pickle.dumps([(10, 20), [3, 4]]))
    assert load_artifact_pickle(path) == [LengthPair(10, 20), LengthPair(3, 4)]
    assert load_trace(path) == [LengthPair(10, 20), LengthPair(3, 4)]


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/paged_llm_pickle_pwned"),))


def test_artifact_pickle_refuses_code(tmp_path):
    marker = Path("/tmp/paged_llm_pickle_pwned")
    marker.unlink(missing_ok=True)
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps([(1, 2), _Evil()]))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_artifact_pickle(path)
    assert not marker.exists()
    path.write_bytes(pickle.dumps([(1, 2, 3)]))
    with pytest.raises(ValueError, match="pair"):
        load_artifact_pickle(path)


class _WordTokenizer:
    def encode(self, text):
        return text.split()


def test_sharegpt_json_first_two_turns(tmp_path):
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "one two three"},
                {"from": "gpt", "value": "four five"},
                {"from": "human", "value": "ignored turn"},
            ],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "alone"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    assert load_sharegpt_json(path, _WordTokenizer()) == [LengthPair(3, 2)]
    with pytest.raises(ValueError, match="tokenizer"):
        load_trace(path)
    assert load_trace(path, _WordTokenizer()) == [LengthPair(3, 2)]


def test_scale_and_prompt_ids():
    assert scale_lengths([LengthPair(160, 320)], 0.125) == [LengthPair(20, 40)]
    assert scale_lengths([LengthPair(1, 1)], 0.1) == [LengthPair(1, 1)]
    r = TimedRequest("x", 7, 3, 0.0)
    assert prompt_token_ids(r) == [0] * 7
    ids = prompt_token_ids(r, vocab_size=100)
    assert len(ids) == 7 and all(3 <= i < 100 for i in ids)


# ---- multi-turn conversations (prefix caching across turns, the KV offload tier) -----------


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=8),
    starts=st.lists(st.floats(0, 100), max_size=6),
    turns=st.integers(1, 6),
    think=st.sampled_from([0.0, 5.0, 30.0]),
)
def test_a_later_turn_replays_the_conversation_so_far(lengths, starts, turns, think):
    from paged_llm.sim.groups import prompt_ids
    from paged_llm.workloads.conversations import conversation_turns

    pairs = [LengthPair(i, o) for i, o in lengths]
    out = conversation_turns(pairs, sorted(starts), seed=1, turns=turns, think_time_s=think,
                             max_total_len=1024)  # fmt: skip
    assert [t.arrival_time for t in out] == sorted(t.arrival_time for t in out)
    by_conv: dict[int, list] = {}
    for t in out:
        by_conv.setdefault(t.conversation, []).append(t)
        assert t.prompt_len + t.reply_len < 1024
    for conv, ts in by_conv.items():
        ts.sort(key=lambda t: t.index)
        assert [t.index for t in ts] == list(range(len(ts))) and len(ts) <= turns
        requests = [TimedRequest(f"{conv}-{t.index}", t.prompt_len, t.reply_len, t.arrival_time,
                                 conversation=conv, history=t.history) for t in ts]  # fmt: skip
        ids = [prompt_ids(r, 0, distinct=False) for r in requests]
        for a, b, r in zip(ids, ids[1:], requests):
            # the next prompt = this prompt + this reply (the simulator's filler 0) + a message
            assert b[: len(a) + r.output_len] == a + [0] * r.output_len
            assert set(b[len(a) + r.output_len :]) == {a[0]}
    # conversations never share a token id, so no prefix is shared across them
    firsts = {prompt_ids(TimedRequest("x", 1, 1, 0.0, conversation=c), 0, False)[0]
              for c in by_conv}  # fmt: skip
    assert len(firsts) == len(by_conv)


def test_a_multi_turn_workload_from_a_spec():
    wl = build_workload(WorkloadSpec(turns=3, think_time_s=10.0, request_rate=0.5,
                                     duration_s=60.0, seed=3))  # fmt: skip
    assert wl.meta["turns"] == 3 and wl.synthetic
    convs = {r.conversation for r in wl.requests}
    assert len(wl.requests) > len(convs) >= 10  # most conversations had a second turn
    assert all(r.input_len > sum(r.history) for r in wl.requests)  # a message of its own
    for bad in (dict(turns=-1), dict(turns=2, n=2), dict(turns=2, think_time_s=-1.0)):
        with pytest.raises(ValueError):
            WorkloadSpec(**bad)
