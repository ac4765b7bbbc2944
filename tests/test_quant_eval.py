"""The quantization benchmark runs end to end (tiny settings, fast test model) and writes
quant_eval.json with every method's perplexity and weight bytes."""

import json

from hydra import compose, initialize_config_dir

from experiments.quant_eval import run_eval, summary
from paged_llm.models import trained

METHODS = ["none", "int8", "int4_rtn", "int4_gptq", "int4_awq", "fp8"]


def test_quant_eval_writes_every_method(tmp_path):
    import os

    overrides = [
        "model.builtin=test-target",
        "perplexity.seq_len=32",
        "perplexity.windows=4",
        "calibration.num_samples=4",
        "calibration.seq_len=32",
        "methods.int4_awq.grid=4",
        "kv_cache_dtypes=[int8]",
        "agreement.methods=[int8]",
        "agreement.max_tokens=4",
        "agreement.prompts=['def f(']",
        "microbench.shapes=[[1,128,64]]",
        "microbench.repeats=1",
    ]
    config_dir = os.path.join(os.path.dirname(__file__), "..", "configs")
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
        cfg = compose(config_name="quant_eval", overrides=overrides)
    result = run_eval(cfg, tmp_path)
    saved = json.loads((tmp_path / "quant_eval.json").read_text())
    assert saved["model"] == str(trained.trained_model_dir("test-target"))
    for name in METHODS:
        assert saved[name]["perplexity"] > 1 and saved[name]["weight_bytes"] > 0
    assert saved["int4_gptq"]["weight_bytes_vs_fp16"] <= 0.3  # group size 128 by default
    assert saved["none"]["kl_divergence"] == 0 and saved["none"]["top1_agreement"] == 1
    assert saved["int4_rtn"]["kl_divergence"] > saved["int8"]["kl_divergence"] > 0
    assert saved["int8"]["weight_bytes_vs_fp16"] < 0.55
    assert saved["kv_cache"]["int8"]["bytes_per_token_vs_fp16"] < 0.6
    assert 0 <= saved["greedy_agreement"]["int8"]["token_agreement"] <= 1
    assert saved["mode"] == "real" and "hardware" in saved
    assert "int4_awq" in summary(result)
