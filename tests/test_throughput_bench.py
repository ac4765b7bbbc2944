"""The offline throughput benchmark (experiments/throughput.py) and its workload functions."""

import json
import statistics
import sys

import pytest

from paged_llm.workloads import lengths as wl

TINY_ARCH = [
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
    "model.arch.vocab_size=256",
    "model.arch.max_position_embeddings=256",
    "model.arch.initializer_range=0.2",  # peaky logits, so greedy choices are not near-ties
]


def _write_csv(path, rows):
    path.write_text("input_len,output_len\n" + "".join(f"{a},{b}\n" for a, b in rows))


def test_load_csv_and_paper_filter(tmp_path):
    path = tmp_path / "lengths.csv"
    _write_csv(path, [(10, 20), (2000, 47), (2000, 48), (0, 5), (100, 1947), (7, 1)])
    pairs = wl.load_length_csv(path)
    assert pairs[0] == (10, 20) and pairs[0].input_len == 10 and len(pairs) == 6
    kept = wl.filter_total_below(pairs, 2048)
    assert kept == [(10, 20), (2000, 47), (100, 1947), (7, 1)]  # strict <, empty input dropped


def test_load_csv_rejects_missing_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("prompt,output_len\n1,2\n")
    with pytest.raises(ValueError, match="input_len"):
        wl.load_length_csv(path)


def test_sample_pairs_is_seeded_and_without_replacement():
    pool = [wl.LengthPair(i, i + 1) for i in range(1, 101)]
    a, b = wl.sample_pairs(pool, 30, seed=3), wl.sample_pairs(pool, 30, seed=3)
    assert a == b and len(set(a)) == 30
    assert wl.sample_pairs(pool, 30, seed=4) != a
    assert len(wl.sample_pairs(pool[:5], 12, seed=0)) == 12  # more than the pool: replacement


def test_synthetic_sharegpt_means_match_the_paper():
    pairs = wl.synthetic_lengths(200_000, seed=0)
    mean_in = statistics.fmean(p.input_len for p in pairs)
    mean_out = statistics.fmean(p.output_len for p in pairs)
    assert abs(mean_in - 161.31) / 161.31 < 0.10
    assert abs(mean_out - 337.99) / 337.99 < 0.10
    assert min(min(p) for p in pairs) >= 1
    assert wl.synthetic_lengths(10, seed=5) == wl.synthetic_lengths(10, seed=5)


def test_scale_to_max_total_keeps_shape_and_limit():
    pairs = [(10, 20), (100, 300), (1, 3000), (3000, 1), (1000, 1000), (128, 128)]
    scaled = wl.scale_to_max_total([wl.LengthPair(*p) for p in pairs], 256)
    assert all(min(a, b) >= 1 and a + b <= 256 for a, b in scaled)
    assert scaled[0] == (10, 20) and scaled[-1] == (128, 128)  # within the limit: untouched
    assert scaled[1] == (64, 192)  # both shrunk by the same factor
    assert scaled[4] == (128, 128)
    many = wl.scale_to_max_total(wl.synthetic_lengths(5000, seed=1), 64)
    assert all(a + b <= 64 and min(a, b) >= 1 for a, b in many)
    with pytest.raises(ValueError):
        wl.scale_to_max_total(pairs, 1)


def _run_benchmark(monkeypatch, tmp_path, overrides):
    """Run ``python -m experiments.throughput`` in-process; return the run directory."""
    from experiments import throughput

    run_dir = tmp_path / "run"
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "cache"))
    argv = ["throughput", f"hydra.run.dir={run_dir}", *overrides]
    monkeypatch.setattr(sys, "argv", argv)
    throughput.main()
    return run_dir


def test_benchmark_end_to_end_matches_hf_generate(monkeypatch, tmp_path):
    csv_path = tmp_path / "trace.csv"
    _write_csv(csv_path, [(30, 50), (5, 7), (3000, 10), (12, 90), (60, 3), (9, 9), (40, 40)])
    overrides = [
        *TINY_ARCH,
        "num_requests=6",
        f"workload.path={csv_path}",
        "workload.max_total=64",
        "generate.batch_size=4",
        "save_outputs=true",
        "repeats=2",
    ]
    run_dir = _run_benchmark(monkeypatch, tmp_path, overrides)
    result = json.loads((run_dir / "throughput.json").read_text())

    for key in ("config", "hardware", "model", "workload", "systems", "command", "date", "notes"):
        assert key in result
    assert result["mode"] == "real"
    assert result["workload"]["source"] == f"trace:{csv_path}"
    assert result["workload"]["num_requests"] == 6
    assert result["model"]["num_parameters"] > 0
    assert result["hardware"]["torch"] and result["hardware"]["cpu"]
    assert result["command"].startswith("python -m experiments.throughput")
    assert set(result["systems"]) == {"paged_llm", "generate", "generate_batch"}
    for stats in result["systems"].values():
        for rate in ("elapsed_s", "cpu_s", "requests_per_s", "output_tokens_per_s"):
            assert stats[rate] > 0
        assert stats["total_tokens_per_s"] > stats["output_tokens_per_s"]
        assert len(stats["elapsed_all_s"]) == 2 and stats["elapsed_s"] == min(
            stats["elapsed_all_s"]
        )
        assert stats["output_tokens"] == result["workload"]["output_tokens"]
    assert set(result["engine_output_speedup"]) == {"generate", "generate_batch"}
    assert all(r > 0 for r in result["engine_output_speedup"].values())
    assert set(result["engine_output_speedup_cpu"]) == {"generate", "generate_batch"}
    assert result["settings"]["generate"]["batch_size"] == 4

    saved = json.loads((run_dir / "outputs.json").read_text())
    engine, lens = saved["outputs"]["paged_llm"], saved["output_lens"]
    assert [len(o) for o in engine] == lens and all(1 <= n <= 63 for n in lens)
    assert engine == saved["outputs"]["generate"]  # token for token, greedy
    assert engine == saved["outputs"]["generate_batch"]
    assert result["output_match"]["generate"]["identical_requests"] == 6


def test_benchmark_synthetic_with_one_generate_batch_call(monkeypatch, tmp_path):
    overrides = [
        *TINY_ARCH,
        "num_requests=3",
        "workload.max_total=24",
        "baselines=[generate_batch]",  # skips static generate
        "generate_batch.per_request_max_tokens=false",
    ]
    run_dir = _run_benchmark(monkeypatch, tmp_path, overrides)
    result = json.loads((run_dir / "throughput.json").read_text())
    assert result["workload"]["source"] == "synthetic"
    assert set(result["systems"]) == {"paged_llm", "generate_batch"}
    assert result["output_match"]["generate_batch"]["identical_requests"] == 3
    stats = result["systems"]["generate_batch"]
    assert stats["generated_tokens"] >= stats["output_tokens"]  # all decode to the longest
