"""oneDNN linear layers on the CPU: same results as nn.Linear, switched only where they apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paged_llm import LLM, SamplingParams
from paged_llm.layers.linear import OneDnnLinear
from paged_llm.layers.linear_setup import onednn_available, onednn_dtypes, use_onednn_linears
from paged_llm.quant.layers import Int8Linear

pytestmark = pytest.mark.skipif(not onednn_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 16, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_nn_linear(dtype, rows, bias):
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, bias=bias).to(dtype)
    fast = nn.Linear(48, 80, bias=bias).to(dtype)
    fast.load_state_dict(plain.state_dict())
    # bf16 only where the CPU has it: elsewhere the layer keeps torch's default
    switched = dtype in onednn_dtypes()
    assert use_onednn_linears(fast, min_rows=4) == int(switched)
    assert isinstance(fast, OneDnnLinear) == switched
    x = torch.randn(rows, 3, 48, dtype=dtype)  # leading dims are flattened into rows (x3)
    with torch.inference_mode():
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(fast(x), plain(x), **tol)


def test_grad_mode_falls_back_to_torch():
    """oneDNN's op has no autograd: a forward that needs gradients takes torch's path."""
    layer = nn.Linear(8, 4)
    use_onednn_linears(layer, min_rows=1)
    y = layer(torch.randn(32, 8)).sum()
    y.backward()
    assert layer.weight.grad is not None


def test_switches_plain_cpu_linears_only():
    model = nn.Sequential(nn.Linear(8, 8), Int8Linear.from_float(nn.Linear(8, 8)), nn.Linear(8, 8))
    model[2].weight = model[0].weight  # tied
    assert use_onednn_linears(model, min_rows=None) == 0
    assert type(model[0]) is nn.Linear
    assert use_onednn_linears(model, min_rows=16) == 2
    assert isinstance(model[0], OneDnnLinear) and type(model[1]) is Int8Linear
    assert model[2].weight is model[0].weight and model[0].min_rows == 16
    half = nn.Linear(8, 8).half()  # no oneDNN CPU kernels for fp16 on most CPUs
    assert use_onednn_linears(half, min_rows=1) == 0


def test_engine_outputs_match_with_and_without_onednn(tiny_llama):
    """Greedy tokens are the same with the oneDNN path (every input of >= 1 row) and without."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 2 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for min_rows in (None, 1):
        llm = LLM(str(tiny_llama[0]), seed=0, cpu_kv_cache_gib=0.01, cpu_onednn_min_rows=min_rows)
        switched = sum(isinstance(m, OneDnnLinear) for m in llm.llm_engine.model.modules())
        assert (switched > 0) == (min_rows is not None)
        outs[min_rows] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outs[None] == outs[1]


def test_cpu_matmul_benchmark_writes_json(tmp_path):
    from experiments import cpu_matmul
    from paper_repro.common import compose

    cfg = compose("cpu_matmul", ["shape=draft", "rows=[1,16]", "threads=[1]", "repeats=1"])
    result = cpu_matmul.write(cfg, tmp_path)
    saved = (tmp_path / "cpu_matmul.json").read_text()
    assert result["mode"] == "real" and '"onednn_speedup"' in saved
    assert [(r["threads"], r["rows"]) for r in result["results"]] == [(1, 1), (1, 16)]
    assert all(r["mkl_ms"] > 0 and r["onednn_ms"] > 0 for r in result["results"])
