"""Swappable parts added from outside the package, reached through a dotted path or a
``_target_`` only: a model architecture, a KV policy, an attention backend, a weight-
quantization method and a queue policy, each defined in this file (the drafter's twin is in
tests/test_spec.py). Each runs in the engine, and what it changes is checked against the
built-in part it varies."""

from __future__ import annotations

from collections import deque

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.attention.torch_backend import TorchAttentionBackend
from paged_llm.core.kv.reservation import OrcaOracleKVCacheManager
from paged_llm.core.queue_policy import FCFS
from paged_llm.core.request import Request
from paged_llm.core.scheduler import Scheduler, SchedulerLimits
from paged_llm.models.llama import LlamaForCausalLM
from paged_llm.quant.layers import Int8Linear
from paged_llm.quant.simple import PerLayerMethod

PROMPTS = [[5, 9, 17, 33, 2 + i] * (i + 1) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HERE = __name__


class OracleWithMargin(OrcaOracleKVCacheManager):
    """Orca (Oracle) that reserves 8 slots more than a request needs."""

    def reserved_tokens(self, request: Request) -> int:
        """The oracle's reservation plus a margin, capped at max_model_len."""
        return min(super().reserved_tokens(request) + 8, self.max_model_len)


class CountingBackend(TorchAttentionBackend):
    """The torch backend, counting its layer calls."""

    name = "counting"
    calls = 0

    def forward(self, *args, **kwargs):
        """Count, then attend as the torch backend does."""
        CountingBackend.calls += 1
        return super().forward(*args, **kwargs)


class Int8Rows(PerLayerMethod):
    """int8 weights per output row, as the built-in int8 method quantizes them."""

    name = "int8-rows"

    def quantize_linear(self, linear):
        """Absmax int8 of each output row."""
        return Int8Linear.from_float(linear)


class ShortestPromptFirst(FCFS):
    """Admit the waiting request with the shortest prompt first."""

    name = "shortest-prompt-first"

    def add(self, waiting: deque[Request], request: Request) -> None:
        """Insert before the first longer prompt."""
        longer = [
            i for i, r in enumerate(waiting) if r.num_prompt_tokens > request.num_prompt_tokens
        ]
        waiting.insert(longer[0] if longer else len(waiting), request)


class CountingLlama(LlamaForCausalLM):
    """A Llama under another architecture name, counting its forward calls."""

    calls = 0

    def forward(self, *args, **kwargs):
        """Count, then run the Llama forward."""
        CountingLlama.calls += 1
        return super().forward(*args, **kwargs)


def renamed_checkpoint(src, dst, architecture: str):
    """A copy of the checkpoint in ``src`` whose config.json names ``architecture``."""
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def run(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return run(LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01))


def test_a_model_architecture_by_configuration_alone(tiny_llama, plain, tmp_path):
    """model_classes={arch: import path} (LLM's keyword or the Hydra model group): a checkpoint
    of an architecture the package does not know runs with our class, giving the Llama's tokens."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from paged_llm.config import engine_config_from_dict

    path = renamed_checkpoint(tiny_llama[0], tmp_path / "ckpt", "CountingForCausalLM")
    with pytest.raises(ValueError, match="unsupported model architecture: CountingForCausalLM"):
        LLM(str(path), block_size=4, cpu_kv_cache_gib=0.01)
    CountingLlama.calls = 0
    classes = {"CountingForCausalLM": f"{HERE}:CountingLlama"}  # vLLM's module:Class works too
    llm = LLM(str(path), block_size=4, cpu_kv_cache_gib=0.01, model_classes=classes)
    assert llm.apply_model(lambda m: type(m).__name__) == ["CountingLlama"]
    assert run(llm) == plain and CountingLlama.calls > 0
    configs = str(__import__("pathlib").Path(__file__).parents[1] / "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        extra = f"+model.model_classes={{Other: {HERE}.CountingLlama}}"
        cfg = compose("config", overrides=[f"model.model={path}", extra])
    ec = engine_config_from_dict(OmegaConf.to_container(cfg, resolve=True))
    assert ec.model.model_classes == {"Other": f"{HERE}.CountingLlama"}


def test_a_model_architecture_through_the_registry(tiny_llama, plain, tmp_path):
    """vLLM's ModelRegistry.register_model, with the class itself; bad entries fail at once."""
    from paged_llm import ModelRegistry

    path = renamed_checkpoint(tiny_llama[0], tmp_path / "ckpt", "RegisteredForCausalLM")
    ModelRegistry.register_model("RegisteredForCausalLM", CountingLlama)
    assert "RegisteredForCausalLM" in ModelRegistry.get_supported_archs()
    assert run(LLM(str(path), block_size=4, cpu_kv_cache_gib=0.01)) == plain
    with pytest.raises(ValueError, match="nn.Module subclass"):
        ModelRegistry.register_model("Bad", object)
    with pytest.raises(ValueError, match="not an import path"):
        ModelRegistry.register_model("Bad", "no path here")
    with pytest.raises(ValueError, match="not an import path"):
        LLM(str(path), model_classes={"Bad": "not a path"})


def test_a_kv_policy(tiny_llama, plain):
    """policy=<dotted path>: the engine's KV manager is ours; outputs stay the model's, and each
    request holds 8 more slots than Orca (Oracle) gives it."""
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01,
              policy=f"{HERE}.OracleWithMargin")  # fmt: skip
    kv = llm.llm_engine.scheduler.kv
    assert isinstance(kv, OracleWithMargin) and run(llm) == plain
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=5), max_model_len=256)
    oracle = OrcaOracleKVCacheManager(num_blocks=64, block_size=4, max_model_len=256)
    assert kv.reserved_tokens(req) == oracle.reserved_tokens(req) + 8


def test_an_attention_backend(tiny_llama, plain):
    CountingBackend.calls = 0
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01,
              attention_backend=f"{HERE}.CountingBackend")  # fmt: skip
    assert llm.llm_engine.backend.name == "counting" and run(llm) == plain
    assert CountingBackend.calls > 0


def test_a_quantization_method(tiny_llama):
    """quantization={"_target_": ...}: the same tokens as the built-in int8 method."""
    ours = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01,
               quantization={"_target_": f"{HERE}.Int8Rows"})  # fmt: skip
    builtin = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01, quantization="int8")
    assert any(isinstance(m, Int8Linear) for m in ours.llm_engine.model.modules())
    assert run(ours) == run(builtin)


def test_a_queue_policy(tiny_llama, plain):
    """scheduling_policy=<dotted path>: shorter prompts are admitted first (plain Python, the
    scheduler alone); in the engine the greedy outputs do not depend on the order."""
    kv = OrcaOracleKVCacheManager(num_blocks=16, block_size=4, max_model_len=64)
    limits = SchedulerLimits(max_num_seqs=1, scheduling_policy=f"{HERE}.ShortestPromptFirst")
    scheduler = Scheduler(kv, limits)
    for i, n in enumerate([9, 3, 6]):
        prompt = list(range(1, n + 1))
        scheduler.add_request(
            Request(str(i), prompt, SamplingParams(max_tokens=2), max_model_len=64)
        )
    assert [r.request_id for r in scheduler.waiting] == ["1", "2", "0"]
    llm = LLM(str(tiny_llama[0]), block_size=4, cpu_kv_cache_gib=0.01,
              scheduling_policy=f"{HERE}.ShortestPromptFirst")  # fmt: skip
    assert isinstance(llm.llm_engine.scheduler.queue, ShortestPromptFirst)
    assert run(llm) == plain
    with pytest.raises(ValueError, match="QueuePolicy subclass"):
        SchedulerLimits(scheduling_policy="collections.OrderedDict")
