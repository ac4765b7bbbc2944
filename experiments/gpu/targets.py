"""The issue's acceptance targets, evaluated from the measured sections."""

from __future__ import annotations

from typing import Any


def evaluate_targets(sections: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
    """The issue's acceptance targets, from the measured sections (None: not measured; always
    None for a CPU smoke run, whose numbers say nothing about a GPU)."""
    if not on_gpu:
        return {"note": "CPU smoke run: the targets apply to GPU runs only", "pass": None}
    rows = sections.get("decode_bandwidth", {}).get("rows", [])
    relevant = [
        r
        for r in rows
        if r["context"] >= 2048 and r["batch"] >= 32 and r["fraction_of_copy_bw"] is not None
    ]
    worst = min((r["fraction_of_copy_bw"] for r in relevant), default=None)
    e2e = sections.get("end_to_end", {})
    vs_gen, vs_batch = e2e.get("speedup_vs_generate"), e2e.get("speedup_vs_generate_batch")
    kernels = sections.get("kernels", {})
    return {
        "kernels_match_reference": kernels.get("all_pass"),
        "sleep_and_offload_keep_outputs": sections.get("sleep_offload", {}).get("all_pass"),
        "fp32_greedy_identical_to_transformers": sections.get("parity", {}).get(
            "fp32_all_identical"
        ),
        "decode_attention_ge_80pct_copy_bw": {
            "worst_fraction": worst,
            "pass": None if worst is None else worst >= 0.8,
            "over": "context >= 2048 and batch >= 32",
        },
        "e2e_ge_10x_generate": {
            "speedup": vs_gen,
            "pass": None if vs_gen is None else vs_gen >= 10,
        },
        "e2e_ge_2x_generate_batch": {
            "speedup": vs_batch,
            "pass": None if vs_batch is None else vs_batch >= 2,
        },
    }
