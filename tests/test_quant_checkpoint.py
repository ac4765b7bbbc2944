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
from paged_llm.quant.base import set_module
from paged_llm.quant.checkpoint import save_quantized
from paged_llm.quant.evaluation import next_token_logprobs, perplexity
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


def _plain(fmt, raw, name, group=GROUP):
    if fmt == "gptq":
        t = [raw[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")]
        return dequantize_gptq_reference(*t, zero_offset=1)
    t = [raw[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales")]
    return dequantize_awq_reference(*t, group_size=group)


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


# GPT-2 and GPT-NeoX checkpoints fuse q, k and v into one layer (GPT-2's c_attn in thirds,
# NeoX's query_key_value interleaved per head), which this project keeps apart.
FUSED = {
    "gpt2": ("transformer.h.{}.attn.c_attn", lambda t: t.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    "gpt-neox": ("gpt_neox.layers.{}.attention.query_key_value", lambda t: t.GPTNeoXConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, rotary_pct=0.25)),
}  # fmt: skip
FUSED_GROUP = 32


@pytest.fixture(scope="module", params=sorted(FUSED))
def fused_written(request, tmp_path_factory):
    """(transformers float model, our int4 model, {"gptq": dir, "awq": dir}, fused layer name)."""
    transformers = pytest.importorskip("transformers")
    fused, make_config = FUSED[request.param]
    config = make_config(transformers)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases off zero, so a misplaced bias row shows
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(root / "float"))
    model, _ = load_model(root / "float", torch.float32)
    rtn = dict(RTN, group_size=FUSED_GROUP)
    q = apply_quantization(model, rtn)
    dirs = {fmt: save_quantized(q, root / fmt, fmt) for fmt in ("gptq", "awq")}
    return hf, q, dirs, fused


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_fused_qkv_checkpoints_mean_to_transformers_what_they_mean_to_us(fused_written, fmt):
    """The file holds the fused layer as transformers names it; loaded, every int4 layer equals
    the one written; and transformers given the file's plainly dequantized weights predicts
    what our loaded model predicts."""
    hf, q, dirs, fused = fused_written
    raw = load_file(str(dirs[fmt] / "model.safetensors"))
    layer0 = fused.format(0)
    assert raw[f"{layer0}.scales"].shape == (64 // FUSED_GROUP, 3 * 64)
    assert not [n for n in raw if "q_proj" in n or "lm_head" in n and "gpt_neox" in layer0]
    loaded, _ = load_checkpoint(dirs[fmt], torch.float32)
    int4 = {n: m for n, m in loaded.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 2 * 6  # q, k, v, output, MLP in and out of both layers
    for name, layer in int4.items():
        assert torch.equal(layer.dequantize(), q.get_submodule(name).dequantize()), name
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name in {n.rsplit(".", 1)[0] for n in raw if n.endswith(".qweight")}:
            module = reference.get_submodule(name)
            plain = _plain(fmt, raw, name, FUSED_GROUP)  # [N, K]
            module.weight.copy_(plain.T if type(module).__name__ == "Conv1D" else plain)
    windows = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = torch.cat(next_token_logprobs(loaded, windows))
    with torch.no_grad():
        theirs = torch.log_softmax(reference(windows).logits[:, :-1].float(), dim=-1)
    torch.testing.assert_close(ours, theirs.reshape(ours.shape), atol=1e-4, rtol=0)
    # and the engine, given the directory, generates what transformers generates
    prompts = [[5, 17, 99, 3], [200, 8]]
    llm = LLM(str(dirs[fmt]), cpu_kv_cache_gib=0.01, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8,
                                          min_new_tokens=8, do_sample=False)  # fmt: skip
        assert list(out.outputs[0].token_ids) == expected[0, len(prompt) :].tolist()


def test_fusing_needs_every_part_int4(fused_written, tmp_path):
    _, q, _, fused = fused_written
    partial = copy.deepcopy(q)
    part = q.fused_linears()[fused.format(0)][0][0]
    float_layer = torch.nn.Linear(64, 64)
    set_module(partial, part, float_layer)
    with pytest.raises(ValueError, match="only some of the layers it fuses are int4"):
        save_quantized(partial, tmp_path / "partial", "gptq")
