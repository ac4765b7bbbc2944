"""``LLM.load_weights``: updating a running engine's model in place from Hugging-Face-named
tensors (an RL loop's weight sync). After a partial or whole update, greedy outputs equal
transformers' with the same new weights (Llama, and GPT-2 whose fused c_attn is split at load),
the prefix cache holds no KV of the old weights, and bad updates change nothing."""

import copy

import pytest
import torch
from test_engine import generate_ids, hf_greedy
from test_models import _hf_model, _save

from paged_llm import LLM, SamplingParams

PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def trained_step(hf_model, names, seed=1):
    """A copy of ``hf_model`` whose parameters matching ``names`` moved (as a training step
    would move them), and those new tensors under their HF names."""
    new = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(seed)
    changed = {}
    with torch.no_grad():
        for name, p in new.named_parameters():
            if any(part in name for part in names):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
                changed[name] = p.detach().clone()
    return new, changed


@pytest.mark.parametrize(
    "case, names",
    [
        ("llama-gqa", ["layers.1.mlp", "layers.0.self_attn.q_proj"]),  # part of the model
        ("llama-gqa", [""]),  # every tensor
        ("gpt2", ["h.0.attn.c_attn", "h.1.mlp.c_proj"]),  # fused q/k/v, Conv1D layout
    ],
)
def test_updated_engine_generates_like_transformers_with_the_new_weights(tmp_path, case, names):
    hf_model = _hf_model(case)
    llm = LLM(str(_save(hf_model, tmp_path)), block_size=4, cpu_kv_cache_gib=0.01,
              enable_prefix_caching=True)  # fmt: skip
    before = generate_ids(llm, PROMPTS, 8)
    assert before == [hf_greedy(hf_model, p, 8) for p in PROMPTS]
    new_model, changed = trained_step(hf_model, names)
    assert llm.load_weights(changed.items()) >= 1
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    after = [o.outputs[0].token_ids for o in outs]
    assert after == [hf_greedy(new_model, p, 8) for p in PROMPTS] and after != before
    # the prefix cache was dropped with the old weights' KV, and fills again
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 4 and again.outputs[0].token_ids == after[0]


def test_bad_updates_change_nothing_and_running_requests_block_them(tmp_path):
    hf_model = _hf_model("llama-gqa")
    llm = LLM(str(_save(hf_model, tmp_path)), cpu_kv_cache_gib=0.01)
    before = generate_ids(llm, PROMPTS, 6)
    good = ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64))
    for bad, words in [
        (("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64)), "unexpected tensors"),
        (("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3)), "shape mismatch"),
    ]:
        with pytest.raises(ValueError, match=words):
            llm.load_weights([good, bad])  # the good tensor is not written either
    assert generate_ids(llm, PROMPTS, 6) == before
    engine = llm.llm_engine
    engine.add_request("running", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="between requests"):
        llm.load_weights([good])
    engine.abort_request("running")
    assert llm.load_weights([good]) == 1


def test_quantized_engines_refuse(tmp_path):
    d = str(_save(_hf_model("llama-gqa"), tmp_path))
    tensor = [("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64))]
    with pytest.raises(ValueError, match="quantized"):
        LLM(d, cpu_kv_cache_gib=0.01, quantization="int8").load_weights(tensor)
