"""Pre-quantized Hugging Face checkpoints in the GPTQ and AWQ layouts: written by this project,
read back by the loader, and checked element by element against a plain dequantization of the
raw tensors in the file; a config that disagrees with its tensors is a clear error."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_llm import LLM, SamplingParams
from paged_llm.models import trained
from paged_llm.models.loader import load_model
from paged_llm.quant import apply_quantization, load_checkpoint
from paged_llm.quant.checkpoint import save_quantized
from paged_llm.quant.evaluation import perplexity
from paged_llm.quant.layers import Int4Linear
from paged_llm.quant.packing import dequantize_awq_reference, dequantize_gptq_reference
from paged_llm.recipes.training import eval_windows

GROUP = 64
RTN = {"_target_": "paged_llm.quant.simple.Int4RTN", "group_size": GROUP}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(in-memory int4 model, {"gptq": dir, "awq": dir}) from the trained test target."""
    src = trained.trained_model_dir("test-target")
    model, _ = load_model(src, torch.float32)
    q = apply_quantization(copy.deepcopy(model), RTN)
    root = tmp_path_factory.mktemp("prequantized")
    dirs = {fmt: save_quantized(q, root / fmt, fmt, tokenizer_dir=src) for fmt in ("gptq", "awq")}
    return q, dirs


def _plain(fmt, raw, name):
    if fmt == "gptq":
        t = [raw[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")]
        return dequantize_gptq_reference(*t, zero_offset=1)
    t = [raw[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales")]
    return dequantize_awq_reference(*t, group_size=GROUP)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_loaded_weights_equal_plain_dequantization(written, fmt):
    q, dirs = written
    cfg = json.loads((dirs[fmt] / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == fmt and cfg["bits"] == 4 and cfg["group_size"] == GROUP
    raw = load_file(str(dirs[fmt] / "model.safetensors"))
    loaded, _ = load_checkpoint(dirs[fmt], torch.float32)
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 7 * 2  # every linear of both decoder layers
    for name, layer in layers.items():
        plain = _plain(fmt, raw, name)
        assert torch.equal(layer.dequantize(), plain), name
        assert torch.equal(plain, q.get_submodule(name).dequantize()), name
    windows = eval_windows(trained.corpus_tokens("test-target", "heldout"), 32, 2)
    assert perplexity(loaded, windows) == pytest.approx(perplexity(q, windows), rel=1e-6)


def test_llm_runs_a_prequantized_checkpoint(written):
    _, dirs = written
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["def main():", "import os\n"]
    src = str(trained.trained_model_dir("test-target"))
    kw = {"cpu_kv_cache_gib": 0.01, "max_model_len": 64}
    llm = LLM(src, quantization=RTN, **kw)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for fmt, d in dirs.items():
        llm = LLM(str(d), quantization=fmt, **kw)  # naming the checkpoint's own method is fine
        assert [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ] == ref
    with pytest.raises(ValueError, match="already gptq-quantized"):
        LLM(str(dirs["gptq"]), quantization="int8", **kw)


def _edited(src, dst, config_edit=None, tensor_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        tensors = load_file(str(dst / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "fmt,edit,message",
    [
        (
            "gptq",
            lambda c: c.update(group_size=128),
            r"but the gptq quantization_config \(.*group_size=128\) implies",
        ),
        (
            "awq",
            lambda c: c.update(group_size=32),
            r"but the awq quantization_config \(.*group_size=32\) implies",
        ),
        ("gptq", lambda c: c.update(bits=8), "only 4-bit"),
        ("awq", lambda c: c.update(version="gemv"), "only the GEMM layout"),
        ("gptq", lambda c: c.update(quant_method="bitsandbytes"), "supported: \\['gptq', 'awq'\\]"),
    ],
)
def test_config_disagreeing_with_tensors_is_refused(written, tmp_path, fmt, edit, message):
    bad = _edited(written[1][fmt], tmp_path / "bad", config_edit=edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(bad, torch.float32)


def test_act_order_g_idx_is_honoured(written, tmp_path):
    name = "model.layers.0.mlp.down_proj"  # 256 inputs, four groups of 64
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    g_idx = (perm // GROUP).to(torch.int32)  # each group still has 64 rows, now scattered

    def shuffle(tensors):
        tensors[f"{name}.g_idx"] = g_idx

    d = _edited(written[1]["gptq"], tmp_path / "act_order", tensor_edit=shuffle)
    loaded, _ = load_checkpoint(d, torch.float32)
    layer = loaded.get_submodule(name)
    assert not layer.plain_groups
    raw = load_file(str(d / "model.safetensors"))
    assert torch.equal(layer.dequantize(), _plain("gptq", raw, name))
