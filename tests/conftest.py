"""Shared fixtures: tiny random Hugging Face checkpoints written with save_pretrained."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # every Triton kernel runs on the CPU here
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402
from machine_share import pytest_runtest_protocol  # noqa: E402, F401 (the hook: alone tests)
from memory_guard import pytest_runtest_logfinish  # noqa: E402, F401 (the hook: engines' memory)
from tiers import TIERS, is_listed_slow, tier_of_file  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Mark each test with its file's tier (tests/tiers.py) unless it names its own, and
    ``slow`` where tests/tiers.py lists it."""
    for item in items:
        if is_listed_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        if any(item.get_closest_marker(t) for t in TIERS):
            continue
        tier = tier_of_file(item.path.stem)
        if tier is not None:  # an unlisted file fails tests/test_tiers.py
            item.add_marker(getattr(pytest.mark, tier))


def save_tiny(kind: str, path, **overrides):
    """Save a tiny random model of one architecture with transformers' own classes."""
    import transformers as tf

    common = dict(
        vocab_size=256, hidden_size=64, num_attention_heads=4, max_position_embeddings=256
    )
    common.update(initializer_range=0.2)  # peaky logits, so greedy choices are not near-ties
    if kind == "llama":
        cfg = tf.LlamaConfig(
            intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2, **common
        )
        cls = tf.LlamaForCausalLM
    elif kind == "opt":
        cfg = tf.OPTConfig(
            ffn_dim=128,
            num_hidden_layers=2,
            word_embed_proj_dim=64,
            init_std=0.2,
            **{k: v for k, v in common.items() if k != "initializer_range"},
        )
        cls = tf.OPTForCausalLM
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(directory, transformers model) of a tiny GQA Llama."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny("llama", path)


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory):
    """(directory, transformers model) of a tiny OPT."""
    path = tmp_path_factory.mktemp("tiny-opt")
    return path, save_tiny("opt", path)


@pytest.fixture
def quiet_preemption_warnings():
    """Random runs preempt often; keep the scheduler's warnings out of the test log."""
    import logging

    log = logging.getLogger("paged_llm.core.scheduler")
    old = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(old)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Materialise built-in presets into a per-session directory, never the user's cache."""
    if "PAGED_LLM_CACHE" not in os.environ:
        os.environ["PAGED_LLM_CACHE"] = str(tmp_path_factory.mktemp("paged-llm-cache"))
    yield
