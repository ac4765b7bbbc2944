"""The GPU simulator: presets, cost model, calibration and the virtual-clock executor."""

import json
from pathlib import Path

import pytest

from paged_llm.metrics.serving import memory_shares, serving_metrics
from paged_llm.sim.calibration import MeasuredStep, calibrate, fit
from paged_llm.sim.cost_model import RooflineCostModel, StepShape
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.hardware import HARDWARE, get_hardware
from paged_llm.sim.model_shapes import MODEL_SHAPES, get_model_shape
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import WorkloadSpec, build_workload

FIG1_CALIBRATION = "calibration/a100-40gb_opt-13b_paper-fig1.json"


def cost(hw="a100-40gb", model="opt-13b", **kw):
    return RooflineCostModel(get_hardware(hw), get_model_shape(model), **kw)


def test_presets_exist_and_opt13b_matches_paper():
    assert set(HARDWARE) >= {"a100-40gb", "a100-80gb", "rtx3090", "h100", "h200"}
    assert set(MODEL_SHAPES) >= {"opt-13b", "opt-66b", "opt-175b", "llama-7b", "llama-13b"}
    m = get_model_shape("opt-13b")
    assert m.kv_bytes_per_token == 2 * 5120 * 40 * 2  # the paper's 800 KB per token
    assert m.weight_bytes / 1e9 == pytest.approx(26, rel=0.02)  # Table 1: 26 GB
    assert get_model_shape("opt-175b").weight_bytes / 1e9 == pytest.approx(346, rel=0.02)
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu")


def test_param_counts_match_transformers_configs():
    from transformers import OPTConfig

    from paged_llm.models.presets import count_parameters, preset_config
    from paged_llm.sim.model_shapes import from_hf_config

    for name in ("opt-13b", "llama-7b", "llama-13b"):
        assert MODEL_SHAPES[name].num_params == count_parameters(preset_config(name))
        assert (
            from_hf_config(preset_config(name)).kv_bytes_per_token
            == MODEL_SHAPES[name].kv_bytes_per_token
        )
    for name, (h, layers, heads) in {
        "opt-66b": (9216, 64, 72),
        "opt-175b": (12288, 96, 96),
    }.items():
        cfg = OPTConfig(
            hidden_size=h,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            ffn_dim=4 * h,
            word_embed_proj_dim=h,
            max_position_embeddings=2048,
        )
        assert MODEL_SHAPES[name].num_params == count_parameters(cfg)


@pytest.mark.parametrize(
    "hw,gpus,model,paper_slots",
    [
        ("a100-40gb", 1, "opt-13b", 15.7e3),
        ("a100-40gb", 4, "opt-66b", 9.7e3),
        ("a100-80gb", 8, "opt-175b", 60.1e3),
    ],
)
def test_kv_slots_close_to_table1(hw, gpus, model, paper_slots):
    cm = cost(hw, model, num_gpus=gpus)
    blocks = cm.num_kv_blocks(0.9, cm.activation_bytes(2560, 256))
    assert blocks * 16 == pytest.approx(paper_slots, rel=0.1)


def test_cost_model_roofline_shape():
    cm = cost()
    t8, t40 = cm.step_time(StepShape.decode(8, 400)), cm.step_time(StepShape.decode(40, 400))
    assert t40 > t8 > cm.model.weight_bytes / cm.bandwidth  # the KV read counts
    assert cm.step_time(StepShape.decode(8, 1600)) > t8
    small = cost(block_size=1).step_time(StepShape.decode(32, 512, block_size=1))
    assert small > cost(block_size=16).step_time(StepShape.decode(32, 512, block_size=16))
    big = cm.breakdown(StepShape(1, 2048, 2048, 128, 2048 * 2049 // 2))
    assert big["compute_s"] > big["memory_s"]  # a long prefill is compute-bound
    assert cm.swap_time(64) > cost(block_size=64).swap_time(16)  # same bytes, fewer copies
    tp = cost(num_gpus=2).step_time(StepShape.decode(8, 400))
    assert tp < t8  # split across two GPUs, plus all-reduces
    assert cost(per_seq_overhead_s=1e-4).step_time(StepShape.decode(40, 400)) == pytest.approx(
        t40 + 4e-3
    )


def test_calibration_recovers_parameters_and_fits_fig1(tmp_path):
    truth = cost(mem_efficiency=0.7, overhead_s=2e-3)
    steps = [StepShape.decode(b, c) for b in (4, 16, 64) for c in (200, 800)]
    fitted = fit(cost(), [MeasuredStep(s, truth.step_time(s)) for s in steps])
    assert fitted["mem_efficiency"] == pytest.approx(0.7, rel=1e-6)
    assert fitted["overhead_s"] == pytest.approx(2e-3, rel=1e-6)
    ex = SimulatedExecutor(calibration=FIG1_CALIBRATION)
    cm = ex.cost_model(16)
    data = json.loads(Path(ex.calibration).read_text())
    for p in data["points"]:
        model = cm.step_time(StepShape.decode(p["num_seqs"], p["context_tokens_per_seq"]))
        assert model == pytest.approx(p["step_time_s"], rel=0.02)
    assert 0.9e12 < cm.bandwidth < 1.1e12  # docs/paper_numbers.md's note: ~0.97 TB/s effective
    with pytest.raises(ValueError, match="executor.calibration=null"):
        calibrate(cost("h100"), ex.calibration)


def small_run(policy, rate=20.0, n=40, blocks=64, **settings):
    wl = build_workload(
        WorkloadSpec(
            request_rate=rate,
            num_requests=n,
            duration_s=None,
            seed=1,
            max_total_len=512,
            length_scale=0.25,
        )
    )
    s = ServingSettings(
        num_gpu_blocks=blocks, max_model_len=512, max_num_batched_tokens=1024, **settings
    )
    return wl, SimulatedExecutor().run(wl, policy, s)


@pytest.mark.parametrize("policy", ["paged", "orca_max", "orca_pow2", "orca_oracle", "static"])
def test_executor_runs_every_request_to_its_length(policy):
    wl, trace = small_run(policy)
    assert trace.mode == "simulated" and "A100-40GB" in trace.hardware
    by_id = {r.request_id: r for r in trace.requests}
    for tr in wl.requests:
        rec = by_id[tr.request_id]
        assert rec.finished and len(rec.token_times) == tr.output_len
        assert (
            rec.arrival_time
            <= rec.first_scheduled_time
            <= rec.first_token_time
            <= rec.finished_time
        )
        assert rec.token_times == sorted(rec.token_times)
    its = trace.iterations
    assert all(b.time >= a.time + a.duration - 1e-9 for a, b in zip(its, its[1:]))
    for it in its:
        assert it.memory.total == 64 * 16
    shares = memory_shares(its)
    assert sum(shares.values()) == pytest.approx(1.0)
    m = serving_metrics(trace)
    assert m["completed"] == len(wl.requests) and m["normalized_latency"] > 0


def test_executor_is_deterministic_and_stops_early():
    _, a = small_run("paged")
    _, b = small_run("paged")
    assert serving_metrics(a) == serving_metrics(b)
    wl = build_workload(WorkloadSpec(request_rate=50.0, duration_s=20.0, seed=0))
    trace = SimulatedExecutor().run(wl, "paged", ServingSettings(num_gpu_blocks=983), stop_time=5.0)
    assert trace.end_time < 5.0 + 1.0 and any(not r.finished for r in trace.requests)


def test_preemption_by_recompute_and_swap_finishes_everything():
    for mode in ("recompute", "swap"):
        wl, trace = small_run("paged", rate=200.0, n=60, blocks=40, preemption_mode=mode)
        assert all(r.finished for r in trace.requests)
        assert serving_metrics(trace)["num_preemptions"] > 0


@pytest.mark.parametrize("field, value", [("n", 3), ("beam_width", 3)])
def test_a_group_that_could_never_run_together_is_refused_before_the_run(field, value):
    """As the engine refuses such a request when it is added: more sequences than max_num_seqs,
    or more blocks than the pool at their longest, would be preempted forever."""
    spec = dict(request_rate=5.0, num_requests=4, duration_s=None, seed=1, max_total_len=512)
    wl = build_workload(WorkloadSpec(**spec, **{field: value}))
    with pytest.raises(ValueError, match="max_num_seqs"):
        SimulatedExecutor().run(wl, "paged", ServingSettings(num_gpu_blocks=200, max_num_seqs=2))
    with pytest.raises(ValueError, match="KV blocks together"):  # 3 x 32 blocks > 64
        SimulatedExecutor().run(wl, "paged", ServingSettings(num_gpu_blocks=64, max_model_len=512))
    trace = SimulatedExecutor().run(wl, "paged", ServingSettings(num_gpu_blocks=200))
    assert all(r.finished for r in trace.requests)


def test_real_executor_tiny_model():
    from paged_llm.sim.real_executor import RealExecutor

    wl = build_workload(
        WorkloadSpec(
            request_rate=float("inf"),
            num_requests=4,
            duration_s=None,
            max_total_len=64,
            length_scale=0.05,
            seed=2,
        )
    )
    s = ServingSettings(num_gpu_blocks=16, max_model_len=128, max_num_batched_tokens=256)
    trace = RealExecutor(warmup_requests=1).run(wl, "orca_oracle", s)
    assert trace.mode == "real" and "CPU" in trace.hardware
    assert all(r.finished and len(r.token_times) == r.output_len for r in trace.requests)
    assert all(it.memory is not None for it in trace.iterations)


def test_measure_step_times_writes_a_loadable_calibration(tmp_path):
    from experiments.measure_step_times import run as measure
    from paper_repro.common import compose

    cfg = compose(
        "measure_step_times",
        ["batch_sizes=[1,2]", "context_tokens=[8]", "steps=2", "engine.num_gpu_blocks=16",
         "engine.max_model_len=64", "calibration.hardware=a100-40gb", "calibration.model=opt-13b"],
    )  # fmt: skip
    path = measure(cfg, tmp_path)
    data = json.loads(path.read_text())
    assert [p["num_seqs"] for p in data["points"]] == [1, 2]
    assert all(p["step_time_s"] > 0 for p in data["points"])
    assert calibrate(cost(), path).overhead_s >= 0  # the format the simulator loads


def test_bookkeeping_and_the_simulator_run_without_torch():
    """Blocks, allocators, scheduler, requests and the simulated executor are plain Python:
    a fresh interpreter runs a simulation (every policy, both preemptions, the metrics, the
    disaggregated layout with its KV connector) without
    ever importing torch, so they can be read, tested and reused on their own."""
    import subprocess
    import sys

    code = """
import sys
from paged_llm.core.kv.block_pool import BlockPool  # imported to show they need no torch
from paged_llm.core.scheduler import Scheduler
from paged_llm.metrics.serving import memory_shares, serving_metrics
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import WorkloadSpec, build_workload
wl = build_workload(WorkloadSpec(request_rate=50.0, num_requests=30, duration_s=None, seed=0,
                                 max_total_len=512, n=2))
runs = [("paged", "swap"), ("paged", "recompute")]
runs += [(p, "recompute") for p in ("orca_max", "orca_pow2", "orca_oracle", "static")]
for policy, mode in runs:
    s = ServingSettings(num_gpu_blocks=128, max_model_len=512, preemption_mode=mode)
    trace = SimulatedExecutor().run(wl, policy, s)
    assert all(r.finished for r in trace.requests), policy
    if policy == "paged":
        assert serving_metrics(trace)["num_preemptions"] > 0, mode
from paged_llm.sim.disagg import simulate  # prefill and decode instances, the KV connector
one = build_workload(WorkloadSpec(request_rate=5.0, num_requests=10, duration_s=None, seed=0))
assert simulate(one, SimulatedExecutor(), ServingSettings()).loaded_blocks > 0
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_public_name_is_exported_lazily():
    """paged_llm/__init__ spells the public names twice (``__all__`` for linters and IDEs,
    ``_EXPORTS`` for the lazy import): they must agree and each must resolve."""
    import paged_llm

    assert set(paged_llm.__all__) == set(paged_llm._EXPORTS)
    aliases = {"GuidedDecodingParams": "StructuredOutputsParams"}  # vLLM's older name
    for name in paged_llm.__all__:
        assert getattr(paged_llm, name).__name__ == aliases.get(name, name)


# ---- sliding windows ----------------------------------------------------------------------------
def test_windowed_steps_read_only_the_window():
    from types import SimpleNamespace

    from paged_llm.sim.executor import step_shape

    def out(before, n):
        request = SimpleNamespace(num_computed_tokens=before)
        return SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=n, request=request)],
                               swap_in=[], swap_out=[], block_ops=[])  # fmt: skip

    decode = step_shape(out(9999, 1), 16, sliding_window=4096)  # position 9999 reads 4096 keys
    assert (decode.kv_tokens_read, decode.attn_pairs) == (4096, 4096)
    assert decode.kv_blocks_read == 625 - (9999 - 4095) // 16
    assert step_shape(out(9999, 1), 16).kv_tokens_read == 10000  # no window: everything
    chunk = step_shape(out(100, 50), 16, sliding_window=64)  # keys 37 .. 149
    assert chunk.kv_tokens_read == 150 - 37 and chunk.attn_pairs == 50 * 64
    short = step_shape(out(0, 30), 16, sliding_window=64)  # shorter than the window: causal
    assert short.attn_pairs == 30 * 31 // 2
    for before in range(0, 40, 3):  # against a brute-force count of min(p + 1, W) per query
        for n in range(1, 20, 4):
            for w in (None, 1, 5, 16, 100):
                keys = [p + 1 if w is None else min(p + 1, w) for p in range(before, before + n)]
                brute = sum(keys)
                assert step_shape(out(before, n), 4, sliding_window=w).attn_pairs == brute


def test_window_from_transformers_configs():
    import transformers as tf

    from paged_llm.sim.model_shapes import from_hf_config

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, sliding_window=32)  # fmt: skip
    assert from_hf_config(tf.MistralConfig(**small)).sliding_window == 32
    mixed = tf.Qwen2Config(**small, use_sliding_window=True, max_window_layers=1)
    assert from_hf_config(mixed).sliding_window is None  # layer 0 has full attention
    shape = get_model_shape("mistral-7b")
    assert shape.sliding_window == 4096 and 7.2e9 < shape.num_params < 7.3e9


def test_freeing_blocks_behind_the_window_batches_more():
    """Long generations of a windowed model in a small pool: the paged policy's freed blocks
    let more requests run at once than keeping every block, and every request completes."""
    from paged_llm.metrics.serving import mean_batched_requests

    ex = SimulatedExecutor(model=get_model_shape("mistral-7b", sliding_window=256))
    spec = WorkloadSpec(request_rate=50.0, num_requests=24, duration_s=None, seed=3,
                        max_total_len=4096, length_scale=4.0, min_output_len=1024)  # fmt: skip
    wl = build_workload(spec)
    engine = dict(num_gpu_blocks=300, max_model_len=4096, max_num_batched_tokens=512,
                  enable_chunked_prefill=True)  # fmt: skip
    runs = {}
    for free in (True, False):
        s = ServingSettings(**engine, free_blocks_behind_window=free)
        trace = SimulatedExecutor.run(ex, wl, "paged", s)
        assert all(r.finished for r in trace.requests)
        runs[free] = (mean_batched_requests(trace.iterations), trace.end_time)
    assert runs[True][0] > 1.5 * runs[False][0] and runs[True][1] < runs[False][1]
