"""experiments/beam_sharing.py on the small trained test model: the real engine's memory saving
from sharing, read off the paged KV manager while parallel sampling and beam search run."""

from __future__ import annotations

import json


def test_savings_are_measured_and_ordered(tmp_path):
    from experiments import beam_sharing

    doc = beam_sharing.run("test-target", 4, (20, 24), tmp_path)
    assert json.loads((tmp_path / "beam_sharing.json").read_text())["mode"] == "real"
    assert all(0 < r["saving"] < 1 for r in doc["settings"].values())  # time-weighted
    # The orderings are checked on the per-iteration mean: the time-weighted saving weighs each
    # step by its wall time, which moves by several points between runs on a busy machine.
    s = {name: r["mean_iteration_saving"] for name, r in doc["settings"].items()}
    assert set(s) == {f"{kind}_{k}" for kind in ("parallel", "beam") for k in (2, 4, 6)}
    assert all(0 < v < 1 for v in s.values())
    # more sequences per request share more; a prompt's beams share more than its samples
    assert s["parallel_2"] < s["parallel_4"] < s["parallel_6"]
    assert s["beam_2"] < s["beam_6"]
    assert all(s[f"beam_{k}"] > s[f"parallel_{k}"] for k in (2, 4, 6))
    # samples share only the prompt's blocks: at most all but one copy of them
    assert s["parallel_6"] < 5 / 6
