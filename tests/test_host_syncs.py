"""Between launching a step's forward and sampling, the runner copies nothing from the host: a
copy from pageable memory waits for the stream, i.e. for the whole forward, which would leave
async output processing nothing to overlap (issue 39). The GPU check counts the syncs on a GPU
(``experiments/gpu_e2e_variants.py``); here the order of the runner's calls is checked."""

from __future__ import annotations

import json

import pytest
import torch

from paged_llm import LLM, SamplingParams


@pytest.mark.parametrize("extra", [{}, {"prompt_logprobs": 1, "logprobs": 2}])
@pytest.mark.parametrize("overlap", ["async_output_proc", "async_scheduling"])
def test_no_host_to_device_copy_between_launch_and_sampling(
    tiny_llama, monkeypatch, extra, overlap
):
    # the GPU path: the triton backend (in the interpreter here), whose layers copy nothing
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01, attention_backend="triton",
              **{overlap: True})  # fmt: skip
    runner = llm.llm_engine.runner
    window = {"open": False}
    copies: list[str] = []
    model_forward, compute_logits = runner.model.forward, runner.model.compute_logits

    def forward(*args, **kwargs):
        window["open"] = True  # from here the device runs the step
        return model_forward(*args, **kwargs)

    def logits(hidden):
        assert window["open"]
        return compute_logits(hidden)

    real_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if window["open"] and kwargs.get("device") is not None:
            copies.append(repr(args)[:60])
        return real_tensor(*args, **kwargs)

    real_execute = runner.execute

    def execute(out, draft_probs=None, while_running=None, **kwargs):
        def close():  # sampling starts after the host work beside the forward
            window["open"] = False
            if while_running is not None:
                while_running()

        return real_execute(out, draft_probs, while_running=close, **kwargs)

    monkeypatch.setattr(runner.model, "forward", forward)
    monkeypatch.setattr(runner.model, "compute_logits", logits)
    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(torch, "tensor", tensor)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **extra)
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 2 + i] * (i + 1)} for i in range(3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert copies == []


def test_int_tensor_matches_torch_tensor_and_outlives_its_buffer():
    import gc

    from paged_llm.runner.batch import int_tensor

    values = [0, -1, 2**40, 7] * 1000
    view = int_tensor(values)[1:5]
    gc.collect()  # the array behind the tensor is kept alive by it
    assert torch.equal(view, torch.tensor(values[1:5])) and view.dtype == torch.int64
    assert int_tensor([]).shape == (0,)


def test_step_inputs_bench_writes_json(tmp_path):
    from experiments import bench_step_inputs
    from paper_repro.common import compose

    doc = bench_step_inputs.write(compose("bench_step_inputs", ["reps=1"]), tmp_path)
    assert doc["what"].startswith("real host-side") and doc["hardware"]["cpu"]
    rows = doc["cases"]
    assert rows["decode_256"]["graph_key"] == [256, 1]
    assert rows["mixed_255_plus_257"]["graph_key"] == [512, 0]  # (tokens, VARLEN)
    assert all(r["int_tensor_ms"] > 0 and r["torch_tensor_ms"] > 0 for r in rows.values())


def test_host_step_bench_writes_each_kind(tmp_path):
    """experiments/bench_host_step.py on a few requests: every output kind's phases, the
    host sum over the phases a GPU waits through, and what and where it measured."""
    from experiments import bench_host_step
    from paper_repro.common import compose

    cfg = compose("bench_host_step", ["requests=3", "steps=2", "repeats=2"])
    doc = bench_host_step.write(cfg, tmp_path)
    assert json.loads((tmp_path / "bench_host_step.json").read_text()) == doc
    assert doc["what"].startswith("real host-side") and doc["hardware"]["cpu"]
    assert doc["command"].startswith("python -m experiments.bench_host_step")
    assert list(doc["kinds"]) == list(bench_host_step.KINDS)
    for row in doc["kinds"].values():
        phases = row["phases_ms"]
        assert {"schedule", "inputs", "forward", "sample", "update"} <= set(phases)
        expected = sum(phases.get(p, 0.0) for p in bench_host_step.HOST_PHASES)
        assert row["batch"] == 3 and len(row["host_ms_windows"]) == 2
        # medians of two windows are their means: the phases' sum is the host sum's median
        assert 0 < row["host_ms"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="unknown output kinds"):
        bench_host_step.write(compose("bench_host_step", ["kinds=[streaming]"]), tmp_path)


def test_to_device_copies_through_pinned_memory_only_to_a_gpu(monkeypatch):
    """On a GPU the step's inputs go through pinned memory, non-blocking (a pageable copy
    waits for the stream: under async scheduling, for the previous step's forward); on the CPU
    the tensor is used as it is."""
    from paged_llm.runner.batch import int_tensor, to_device

    host = int_tensor([3, 1, 4])
    assert to_device(host, torch.device("cpu")) is host and to_device(host, "cpu") is host
    calls = []

    class Pinned:
        def to(self, device, non_blocking=False):
            calls.append((str(device), non_blocking))
            return "on device"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: Pinned())
    assert to_device(host, torch.device("cuda", 0)) == "on device"
    assert calls == [("cuda:0", True)]
