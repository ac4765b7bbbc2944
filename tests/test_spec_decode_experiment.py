"""experiments/spec_decode.py on the small trained test pair: the sweep, its summary and the
formula it checks (tokens per target step vs (1 - a^(k+1)) / (1 - a))."""

from __future__ import annotations

import pytest

pytest.importorskip("hydra")


def test_sweep_writes_speedups_and_formula_gaps(tmp_path):
    from experiments import spec_decode

    cfg = dict(
        target="test-target", draft="test-draft", eagle="test-eagle",
        methods=["draft_model", "eagle", "ngram"], ks=[1, 3],
        batch_sizes=[1, 2], prompt_len=16, max_tokens=12, num_prompts=2, block_size=16, seed=0,
        repeats=1, num_threads=1,
    )  # fmt: skip
    results = spec_decode.run(cfg, tmp_path)
    assert (tmp_path / "spec_decode.json").is_file() and (tmp_path / "spec_decode.png").is_file()
    assert set(results["baseline"]) == {"1", "2"}
    assert len(results["runs"]) == 3 * 2 * 2
    for r in results["runs"]:
        assert r["speedup"] > 0 and r["output_tokens_per_s"] > 0
        # at most k + 1 tokens per target step (k accepted drafts + the target's own token)
        assert 1.0 <= r["tokens_per_target_step"] <= r["k"] + 1
        assert 1.0 <= r["predicted_tokens_per_step"] <= r["k"] + 1
    summary = results["summary"]
    assert set(summary["best_speedup"]) == {
        f"{m}/batch_{b}" for m in ("draft_model", "eagle", "ngram") for b in (1, 2)
    }
    for gaps in (summary["max_formula_gap"], summary["max_formula_gap_by_source"]):
        assert set(gaps) == {"draft_model", "eagle", "ngram"} and min(gaps.values()) >= 0.0
    # a model drafter has one draft source: both predictions agree
    for m in ("draft_model", "eagle"):
        assert summary["max_formula_gap_by_source"][m] == summary["max_formula_gap"][m]
    assert results["mode"] == "real"


def test_every_batch_size_generates_from_the_same_prompts():
    from experiments.spec_workload import prompt_batches

    pool = [[i] for i in range(4)]
    assert prompt_batches(pool, 1) == [[[0]], [[1]], [[2]], [[3]]]
    assert prompt_batches(pool, 2) == [[[0], [1]], [[2], [3]]]
    assert prompt_batches(pool, 4) == [pool]
    assert prompt_batches(pool, 6) == [pool + pool[:2]]  # larger than the pool: repeat it
