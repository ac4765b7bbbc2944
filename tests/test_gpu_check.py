"""The GPU fast path and GPU check, as far as a CPU can check them: the smoke mode of the GPU
check (experiments/gpu/) writes a well-formed JSON, and the CUDA-graph bucketing, padding and
replay plumbing gives the same tokens as eager steps (replayed eagerly here, with the Triton
kernels in the interpreter)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from graph_replay import replay_graphs_eagerly

from paged_llm import LLM, SamplingParams
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.attention.triton_backend import TritonAttentionBackend
from paged_llm.runner.cuda_graphs import (
    CudaGraphRunner,
    bucket_for,
    capture_sizes,
    cuda_graph_sizes,
    pad_batch,
)

SECTIONS = ["bandwidth", "kernels", "parity", "kernel_sweep", "decode_bandwidth", "fig18a",
            "end_to_end", "quant_decode", "sleep_offload", "spec_decode"]  # fmt: skip


# The device machine has torch, triton and transformers but none of these (docs/gpu.md): the
# check runs with them hidden, as there. A hidden package is one no finder finds, so that
# transformers' availability probes see it absent instead of failing.
HIDDEN = ("hydra", "omegaconf", "wandb", "fastapi", "uvicorn", "xgrammar", "submitit")
RUN_WITHOUT = """
import json, sys
HIDDEN = set(sys.argv[1].split(","))

class Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)

sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
from pathlib import Path
import experiments.gpu
from experiments.gpu import cli, report
doc = cli.main(sys.argv[2:])
written = json.loads((Path(sys.argv[-1]) / "gpu_check.json").read_text())
assert written == json.loads(json.dumps(doc, default=report.json_default))
assert not HIDDEN & {m.partition(".")[0] for m in sys.modules}
"""


def test_smoke_run_writes_well_formed_json(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    argv = ["--smoke", "--extras", "--out", str(tmp_path)]  # --out last: the script reads it
    subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT, ",".join(HIDDEN), *argv], cwd=root, check=True
    )
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    from experiments.gpu.report import SCHEMA

    assert doc["schema"] == SCHEMA and doc["mode"] == "smoke"
    assert doc["measured"] is False and doc["device"]["type"] == "cpu"
    assert list(doc["sections"]) == SECTIONS
    for name, section in doc["sections"].items():
        # a loaded machine may run out of the smoke budget, but nothing may fail
        assert section["status"] in ("ok", "skipped"), (name, section.get("reason"))
        assert section["seconds"] >= 0
    kernels = doc["sections"]["kernels"]
    assert kernels["status"] == "ok" and kernels["all_pass"], kernels["failed"]
    assert {c["check"] for c in kernels["checks"]} >= {
        "store_kv", "store_kv_int8", "paged_decode_splits_4", "paged_decode_int8_cache",
        "paged_prefill", "copy_blocks", "int8_matmul_rows_1", "int8_matmul_rows_5",
        "int4_matmul_rows_1", "int4_matmul_rows_5", "fp8_matmul_rows_1", "lora_rows_7",
        "fused_moe_tokens_7", "fused_moe_int4_tokens_7",
    }  # fmt: skip
    bw = doc["sections"]["bandwidth"]
    assert bw["copy_bandwidth_GBps"] > 0 and bw["matmul_bf16_TFLOPs"] > 0
    for row in doc["sections"]["decode_bandwidth"]["rows"]:
        assert row["achieved_GBps"] > 0 and row["fraction_of_copy_bw"] > 0
    e2e = doc["sections"]["end_to_end"]
    if e2e["status"] == "ok":
        assert e2e["ours"]["generated_tokens"] > 0
        assert e2e["tokens_match_generate"] in (True, None)  # same weights: same greedy tokens
        assert e2e["bandwidth_bound"]["output_tokens_per_s"] > 0
        phases = e2e["step_phases"]  # where the timed run's step time went
        assert phases["steps"] > 0 and phases["phases"]["forward"]["seconds"] > 0
    assert doc["targets"]["pass"] is None  # CPU numbers never pass or fail a GPU target
    parity = doc["sections"]["parity"]
    if parity["status"] == "ok" and not parity["skipped"]:
        assert {r["arch"] for r in parity["rows"]} == {"llama-gqa", "mistral", "qwen2", "opt"}
        assert all("error" not in r for r in parity["rows"]), parity["rows"]
        assert parity["fp32_all_identical"], parity["rows"]
    sweep = doc["sections"]["kernel_sweep"]
    if sweep["status"] == "ok":
        assert sweep["decode"]["best_overall"]["config"]
        for shape in sweep["matmul"]["shapes"]:
            assert shape["bf16_linear"]["seconds"] > 0
            for name in ("int8", "int4"):
                paths = shape[name]
                assert set(paths) == ({"dot", "gemv"} if shape["rows"] <= 4 else {"dot"})
                assert all("error" not in c for p in paths.values() for c in p["configs"])
        best = sweep["matmul"]["best_overall"]
        # a loaded machine can run out of the smoke budget mid-sweep (seen in a fresh-clone
        # run): then a kernel may have no config timed on every shape
        for key in ("int8_dot", "int4_gemv"):
            assert best[key]["config"] if best[key] else sweep["matmul"]["out_of_time"], key
        assert best["int8_gemv_rows"] in (0, 1, 4)
    quant = doc["sections"]["quant_decode"]
    if quant["status"] == "ok":
        for method in ("none", "int8", "int4_rtn", "fp8"):
            row = quant["methods"][method]
            assert "error" not in row, (method, row.get("error"))
            assert row["batch_1"]["decode_steps"] > 0 and row["weight_bytes"] > 0
        assert (
            quant["methods"]["int4_rtn"]["weight_bytes"] < quant["methods"]["none"]["weight_bytes"]
        )
    memory = doc["sections"]["sleep_offload"]
    if memory["status"] == "ok" and "stopped" not in memory:
        assert memory["all_pass"], memory
        assert [r["level"] for r in memory["levels"]] == [1, 2]
        assert memory["offload"]["blocks_copied_back"] > 0
        assert memory["pinned_cache_GiB_before_engine"] == 0  # no CUDA allocator on the CPU
        if "kv_transfer" in memory:  # run when the smoke budget left room for it
            assert memory["kv_transfer"]["kv_consumer"]["blocks_loaded"] > 0
    spec = doc["sections"]["spec_decode"]
    if spec["status"] == "ok":  # the CPU smoke run does every part, whatever the budget
        exact = spec["exactness_float32"]
        assert set(exact) == {"draft_model", "eagle", "ngram"}
        # the same CPU kernels verify and decode: greedy outputs are identical
        assert all(row["identical_outputs"] == 1.0 for row in exact.values()), exact
        rows = spec["speed"]["rows"]
        assert {r["method"] for r in rows} == {"none", "draft_model", "eagle", "ngram"}
        assert all(r["output_tokens_per_s"] > 0 and r["speedup"] > 0 for r in rows)
        assert all(r["tokens_per_target_step"] >= 1 for r in rows if r["method"] != "none")


def test_spec_models_export_round_trip(tmp_path):
    """The export the device run reads: bfloat16 checkpoints of target, draft and EAGLE head
    plus prompts, which the section finds and an engine on them runs with its drafter."""
    from experiments.gpu import spec_decode as gsd
    from experiments.gpu.plans import PLANS

    gsd.export(tmp_path, gsd.SMOKE, num_prompts=3, prompt_len=8)
    dirs, prompts = gsd._models(PLANS["quick"], str(tmp_path))
    assert set(dirs) == {"target", "draft", "eagle"} and len(prompts) == 3
    assert all(len(p) == 8 for p in prompts)
    for role in dirs:
        config = json.loads((tmp_path / role / "config.json").read_text())
        assert config["torch_dtype"] == "bfloat16"
        assert (tmp_path / role / "tokenizer.json").is_file()
    spec = {"method": "eagle", "model": dirs["eagle"], "num_speculative_tokens": 2}
    llm = LLM(dirs["target"], dtype="float32", speculative_config=spec, seed=0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    with pytest.raises(FileNotFoundError, match="--export"):
        gsd._models(PLANS["quick"], str(tmp_path / "missing"))


# ---- CUDA graphs: the logic that does not need a GPU ---------------------------------------------
def test_capture_sizes_and_buckets():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


def decode_batch(positions, tables):
    """A pure-decode HostBatch-like batch: one token per sequence at ``positions``."""
    n = len(positions)
    return SimpleNamespace(
        input_ids=[7] * n, positions=list(positions), query_lens=[1] * n,
        seq_lens=[p + 1 for p in positions], block_tables=[list(t) for t in tables],
    )  # fmt: skip


def test_padding_writes_nowhere_and_reads_nothing():
    batch = decode_batch([5, 0], [[3, 9], [4]])  # block size 4: slots 9*4+1 and 4*4+0
    padded = pad_batch(batch, bucket=4, stride=1, block_size=4, width=3)
    assert padded.slot_mapping == [37, 16, -1, -1]
    assert padded.seq_lens == [6, 1, 0, 0]
    assert padded.input_ids == [7, 7, 0, 0] and padded.positions == [5, 0, 0, 0]
    # the real rows only, to the widest of them: the rest of the static buffer is never read
    assert padded.block_tables.tolist() == [[3, 9], [4, 0]]
    with pytest.raises(ValueError, match="at most 1"):
        pad_batch(batch, bucket=1, stride=1, block_size=4, width=3)
    with pytest.raises(ValueError, match="wider"):
        pad_batch(batch, bucket=2, stride=1, block_size=4, width=1)
    prefill = SimpleNamespace(**{**vars(batch), "query_lens": [1, 2]})
    with pytest.raises(ValueError, match="decode batch"):
        pad_batch(prefill, bucket=2, stride=1, block_size=4, width=3)


def test_graphs_only_on_cuda_without_enforce_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert cuda_graph_sizes(cuda, False, triton, 1, 8) == [1, 2, 4, 8]
    assert cuda_graph_sizes(cpu, False, triton, 1, 8) == []
    assert cuda_graph_sizes(cuda, True, triton, 1, 8) == []  # enforce_eager
    assert cuda_graph_sizes(cuda, False, torch_backend, 1, 8) == []  # host-side reads
    assert cuda_graph_sizes(cuda, False, triton, 2, 8) == []  # tensor parallel: eager


def test_padded_bucket_replay_gives_the_same_tokens(tiny_llama, monkeypatch):
    prompts = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    kwargs = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01, max_num_seqs=4,
                  attention_backend="triton")  # fmt: skip

    def generate(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    eager = LLM(str(tiny_llama[0]), **kwargs)
    assert eager.llm_engine.runner.cuda_graphs is None  # the CPU never captures
    expected = generate(eager)
    llm = LLM(str(tiny_llama[0]), **kwargs)
    graphs = replay_graphs_eagerly(llm, monkeypatch, capture_sizes(4))
    assert generate(llm) == expected
    # 3 decoding (bucket 4, one padding row), then 2 (bucket 2), then 1 (bucket 1)
    assert set(graphs.replays) == {(4, 1), (2, 1), (1, 1)}


def test_verification_padding_keeps_positions_and_writes_nowhere():
    # block size 4; a verification of 3 tokens at 5-7 and a decode at 2, stride 3, bucket 4
    batch = SimpleNamespace(
        input_ids=[7, 8, 9, 6], positions=[5, 6, 7, 2], query_lens=[3, 1], seq_lens=[8, 3],
        block_tables=[[3, 9], [4]],
    )  # fmt: skip
    padded = pad_batch(batch, bucket=4, stride=3, block_size=4, width=3)
    assert padded.rows == [0, 1, 2, 3]  # the decode's token moves to its sequence's row 3
    assert padded.input_ids == [7, 8, 9, 6, 0, 0] + [0] * 6
    assert padded.positions == [5, 6, 7, 2, 2, 2] + [0] * 6  # padding repeats the last position
    assert padded.slot_mapping == [37, 38, 39, 18, -1, -1] + [-1] * 6
    # the decode's context grows by its 2 padding queries, so its real query stays at 2
    assert padded.seq_lens == [8, 5, 3, 3]
    # padding sequences read block 0
    assert padded.block_tables.tolist() == [[3, 9, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="1 to 2 query tokens"):
        pad_batch(batch, bucket=4, stride=2, block_size=4, width=3)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_verification_and_draft_graphs_give_the_same_tokens(tiny_llama, method, monkeypatch):
    """Speculative steps through graphs of stride k + 1 (the target's verifications, the draft
    model's catch-up steps) and stride 1 (its one-token steps), replayed eagerly."""
    prompts = [[5, 9, 17, 33, 2 + i] * (i + 2) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(block_size=4, max_model_len=64, cpu_kv_cache_gib=0.01, max_num_seqs=4,
                  attention_backend="triton")  # fmt: skip

    def generate(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    expected = generate(LLM(str(tiny_llama[0]), **kwargs))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":  # the target drafting for itself: every draft is accepted
        spec["model"] = str(tiny_llama[0])
    llm = LLM(str(tiny_llama[0]), speculative_config=spec, **kwargs)
    graphs = replay_graphs_eagerly(llm, monkeypatch, capture_sizes(4), strides=(1, 4))
    assert generate(llm) == expected
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    assert any(s == 4 for _, s in graphs.replays)  # verifications replayed
    assert llm.llm_engine.runner.forward_kinds["graph_q4"] > 0
    if method == "draft_model":
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
        assert {s for _, s in llm.llm_engine.drafter.cuda_graphs.replays} == {1, 4}


def test_a_failed_verification_capture_keeps_the_decode_graphs(monkeypatch):
    graphs = CudaGraphRunner(None, None, [], None, [1, 2, 4], 4, 64, torch.device("cpu"),
                             strides=(1, 5))  # fmt: skip
    assert graphs.keys == [(1, 1), (2, 1), (4, 1), (1, 5), (2, 5), (4, 5)]

    def capture_one(key, pool):
        if key == (2, 5):
            raise RuntimeError("operation not permitted when stream is capturing")
        graphs.graphs[key], graphs.outputs[key] = "graph", "output"

    monkeypatch.setattr(graphs, "_capture_one", capture_one)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs.capture()
    assert sorted(graphs.graphs) == [(1, 1), (2, 1), (4, 1)] and graphs.strides == [1]
    verification = SimpleNamespace(input_ids=[1, 2], positions=[3, 4], query_lens=[2],
                                   seq_lens=[5], block_tables=[[0, 1]])  # fmt: skip
    assert graphs.key_for(verification) is None
    assert graphs.key_for(decode_batch([3], [[0]])) == (1, 1)

    def decode_fails(key, pool):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(graphs, "_capture_one", decode_fails)
    with pytest.raises(RuntimeError, match="capture failed"):  # the runner then stays eager
        graphs.capture()


def test_failed_capture_leaves_the_engine_eager(tiny_llama, monkeypatch):
    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CudaGraphRunner, "capture", broken)
    llm = LLM(str(tiny_llama[0]), cpu_kv_cache_gib=0.01)
    runner = llm.llm_engine.runner
    runner.capture_cuda_graphs([1, 2], 64)
    assert runner.cuda_graphs is None and "not permitted" in runner.cuda_graph_error
    out = llm.generate({"prompt_token_ids": [5, 9, 17]}, SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


def test_static_generate_smoke_writes_json_and_profile(tmp_path):
    """experiments/gpu_static_generate (whole static batches + a profile) on the CPU."""
    from experiments import gpu_static_generate

    doc = gpu_static_generate.main(["--smoke", "--out", str(tmp_path), "--seconds", "30"])
    assert doc["mode"] == "real" and doc["measured"] is False and doc["device"]["type"] == "cpu"
    run = doc["hf_generate"]
    assert run["requests"] > 0 and run["output_tokens_per_s"] > 0
    assert json.loads((tmp_path / "static_generate.json").read_text())["hf_generate"] == json.loads(
        json.dumps(run, default=str)
    )
    assert "aten::" in (tmp_path / "generate_profile.txt").read_text()


def test_section_caps_parse_or_fail_clearly():
    from experiments.gpu.cli import parse_caps

    assert parse_caps(["parity=110", "end_to_end=30.5"]) == {"parity": 110.0, "end_to_end": 30.5}
    for bad in ("bandwidth=3", "parity", "parity=soon"):
        with pytest.raises(SystemExit, match="--cap"):
            parse_caps([bad])


def test_the_sleep_probe_summarises_segments_biggest_first_with_live_sites():
    from experiments.gpu_sleep_probe import segments

    mib = 2**20
    frame = {"filename": "/x/paged_llm/models/llama.py", "line": 67, "name": "forward"}
    torch_frame = {"filename": "/usr/torch/nn/functional.py", "line": 1, "name": "linear"}
    snapshot = {"segments": [
        {"total_size": 40 * mib, "allocated_size": 32 * mib, "is_expandable": True,
         "segment_pool_id": (0, 0), "blocks": [
             {"size": 32 * mib, "state": "active_allocated", "frames": [torch_frame, frame]},
             {"size": 8 * mib, "state": "inactive", "frames": []}]},
        {"total_size": 1024 * mib, "allocated_size": 0, "is_expandable": False,
         "segment_pool_id": (0, 0), "blocks": [{"size": 1024 * mib, "state": "inactive"}]},
    ]}  # fmt: skip
    rows = segments(snapshot)
    assert [r["total_MiB"] for r in rows] == [1024.0, 40.0]
    assert rows[0]["live_blocks"] == []
    assert rows[1]["live_blocks"] == [{"MiB": 32.0, "site": "llama.py:67 forward"}]


def test_spec_profile_smoke_writes_phases(tmp_path):
    """experiments/gpu_spec_profile (speed, phase times, profiles per drafter) on the CPU."""
    from experiments import gpu_spec_profile

    doc = gpu_spec_profile.main(["--smoke", "--out", str(tmp_path)])
    assert [r["method"] for r in doc["runs"]] == ["none", "ngram", "draft_model", "eagle"]
    for row in doc["runs"]:
        phases = row["batch_1"]["phases_ms_per_step"]
        assert row["tokens_per_s"]["1"] > 0 and row["batch_1"]["steps"] > 0
        assert {"schedule", "plugins", "inputs", "forward", "sample", "update"} <= set(phases)
        assert all(ms >= 0 for ms in phases.values()) and row["batch_1"]["host_ms_per_step"] > 0
        assert (tmp_path / f"profile_{row['method']}.txt").is_file()
    busy = doc["ngram_beside_busy_thread"]
    assert busy["alone_tokens_per_s"] > 0 and busy["beside_busy_thread_tokens_per_s"] > 0
    assert json.loads((tmp_path / "spec_profile.json").read_text())["runs"] == doc["runs"]


def test_e2e_variants_smoke_writes_each_variant(tmp_path):
    """experiments/gpu_e2e_variants.py (issue 39's before/after on a GPU) on the CPU: every
    variant runs the same requests and reports its rate, bound fraction, phases and kinds."""
    from experiments import gpu_e2e_variants

    doc = gpu_e2e_variants.main(["--smoke", "--budget", "60", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "gpu_e2e_variants.json").read_text())
    assert written["what"].startswith("real engine runs") and written["device"] == "cpu"
    assert list(written["variants"]) == list(gpu_e2e_variants.DEFAULT_VARIANTS)
    for name, row in doc["variants"].items():
        assert "error" not in row, row
        assert row["output_tokens_per_s"] > 0 and row["fraction_of_bound"] > 0
        assert "inputs" in row["step_phases"]["phases"] and row["steps_by_kind"]
        assert all(row["host_probe_ms"][k] > 0 for k in ("before", "after"))
        assert row["syncs_per_step"] == row["syncs_per_step_sampled"] == {"note": "CUDA only"}
        if name != "mixed_graphs":  # the same greedy tokens as the first variant
            assert row["same_tokens_as_first"] == 1.0
        if name == "mixed_graphs_async_sched":  # its decode steps left their ids on the device
            assert row["deferred_steps"] > 0
        else:
            assert row["deferred_steps"] == 0
    # the kernel profile (operators on the CPU): merged q/k/v and gate/up are 2 GEMMs a layer
    # fewer (2 layers, + the LM head), and each step's kinds add up to its busy time
    linears = {}
    for name in ("mixed_graphs", "mixed_graphs_unmerged"):
        kb = doc["variants"][name]["kernel_breakdown"]
        assert kb["source"] == "cpu" and kb["running"] == kb["batch"] >= 1
        assert kb["decode"]["last_kind"] == "eager_decode" and kb["mixed"]["kind"]
        for part in ("decode", "mixed"):
            row = kb[part]
            assert sum(row["ms_per_step"].values()) == pytest.approx(row["busy_ms"])
            assert row["ms_per_step"]["gemm"] > 0 and row["wall_ms"] > 0 and row["busy_ms"] > 0
        busiest = {b["name"]: b["calls_per_step"] for b in kb["decode"]["busiest"]}
        linears[name] = busiest["mkldnn::_linear_pointwise"]
        assert kb["bound_ms"]["step_ms"] == pytest.approx(sum(
            kb["bound_ms"][k] for k in ("weights_ms", "kv_ms")))  # fmt: skip
    assert linears == {"mixed_graphs": 2 * 4 + 1, "mixed_graphs_unmerged": 2 * 7 + 1}
    assert "kernel_breakdown" not in doc["variants"]["mixed_graphs_async_sched"]
    with pytest.raises(SystemExit):
        gpu_e2e_variants.main(["--smoke", "--variants", "nope", "--out", str(tmp_path)])


def test_run_ours_counts_the_same_tokens_from_final_only_outputs(tiny_llama):
    """The end-to-end loop reading outputs as LLM.generate does (only at the finish) gets the
    same tokens and counts as reading every step's cumulative outputs, also when the deadline
    cuts the run short (the unfinished requests' progress is read from the engine)."""
    from experiments.common.timing import Deadline
    from experiments.common.workloads import Workload
    from experiments.gpu.end_to_end import run_ours

    work = Workload([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [5, 9, 3], "test")
    runs = {}
    for kind in ("cumulative", "final_only"):
        llm = LLM(str(tiny_llama[0]), dtype="float32", seed=0, max_num_seqs=2)
        runs[kind] = run_ours(llm.llm_engine, work, Deadline.after(60), kind)
    assert runs["cumulative"]["outputs"] == runs["final_only"]["outputs"]
    assert runs["cumulative"]["generated_tokens"] == runs["final_only"]["generated_tokens"] == 17
    assert runs["final_only"]["output_kind"] == "final_only"

    class StepCounter:  # a deadline that passes after three steps
        def __init__(self):
            self.calls = 0

        def left(self):
            self.calls += 1
            return 1.0 if self.calls <= 3 else 0.0

    cut = {}
    for kind in ("cumulative", "final_only"):
        llm = LLM(str(tiny_llama[0]), dtype="float32", seed=0, max_num_seqs=2)
        cut[kind] = run_ours(llm.llm_engine, work, StepCounter(), kind)
        assert cut[kind]["partial"] and not llm.llm_engine.has_unfinished_requests()
    assert cut["cumulative"]["generated_tokens"] == cut["final_only"]["generated_tokens"] > 0


def test_run_ours_counts_only_tokens_on_the_host_under_async_scheduling(tiny_llama):
    """With async scheduling the loop gets the same tokens; a run cut by the deadline counts
    the tokens that reached the host, not the placeholders of the step still in flight."""
    from experiments.common.timing import Deadline
    from experiments.common.workloads import Workload
    from experiments.gpu.end_to_end import run_ours

    work = Workload([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [5, 9, 3], "test")

    def engine(**kw):
        return LLM(str(tiny_llama[0]), dtype="float32", seed=0, max_num_seqs=2, **kw).llm_engine

    sync = run_ours(engine(), work, Deadline.after(60))
    pipelined = run_ours(engine(async_scheduling=True), work, Deadline.after(60))
    assert pipelined["outputs"] == sync["outputs"] and pipelined["generated_tokens"] == 17

    class After:  # a deadline that passes after ``steps`` steps
        def __init__(self, steps):
            self.steps = steps

        def left(self):
            self.steps -= 1
            return 1.0 if self.steps >= 0 else 0.0

    pipelined_engine = engine(async_scheduling=True)
    cut = run_ours(pipelined_engine, work, After(3))
    assert not pipelined_engine.has_unfinished_requests()  # the step in flight was taken
    two_steps = run_ours(engine(), work, After(2))
    # three calls launched three steps; the third's tokens were still on the device
    assert cut["partial"] and cut["generated_tokens"] == two_steps["generated_tokens"] == 4


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_TNT", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
        ("_int8_matmul_kernel", "gemm"),
        ("aten::addmm", "gemm"),
        ("_paged_decode_kernel", "attention"),
        ("_paged_prefill_kernel", "attention"),
        ("_store_kv_kernel", "kv_store"),
        ("_rms_norm_kernel", "norm_rope_act"),
        ("_rotary_kernel", "norm_rope_act"),
        ("_silu_mul_kernel", "norm_rope_act"),
        (
            "void at::native::vectorized_elementwise_kernel<8, at::native::AddFunctor>",
            "torch_elementwise",
        ),
        ("void at::native::reduce_kernel<512, 1, at::native::ArgMaxOps>", "sampling"),
        ("Memcpy HtoD (Pinned -> Device)", "memory"),
        ("Memset (Device)", "memory"),
        ("cudaGraphLaunch", "other"),
    ],
)
def test_kernels_are_counted_under_their_kind(name, kind):
    """Names as run 11's H200 profile shows them (kernel_breakdown.KINDS)."""
    from experiments.kernel_breakdown import kind_of

    assert kind_of(name) == kind


def test_kernel_summary_adds_per_step():
    from experiments.kernel_breakdown import summarise

    timed = [("nvjet_a", 10.0), ("nvjet_a", 14.0), ("_rotary_kernel", 2.0), ("mystery", 4.0)]
    row = summarise(timed, steps=2, wall_s=[0.001, 0.003, 0.002])
    assert row["ms_per_step"] == {"gemm": 0.012, "norm_rope_act": 0.001, "other": 0.002}
    assert row["busy_ms"] == pytest.approx(0.015) and row["wall_ms"] == pytest.approx(2.0)
    assert row["busiest"][0] == {"name": "nvjet_a", "calls_per_step": 1.0, "us_each": 12.0}
