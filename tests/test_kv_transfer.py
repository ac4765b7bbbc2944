"""KV transfer between engines (``kv_transfer_config``, disaggregated prefill): a producer engine
saves the KV of the prompts it computes through a connector, a consumer engine loads it instead
of computing it.

The property test drives two real schedulers (a producer, then a consumer) over random prompts
that share prefixes, on small pools that evict, preempt and chunk, with a fake store, and plays
every block move on shadow pools holding the token ids each block's KV was computed from:
whatever a request counts as computed holds exactly its tokens, every saved block holds the full
block its key names, and no block leaks. The engine tests check greedy outputs against an engine
that computes everything."""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from shadow_pools import BS, run_with_shadow_pools

from paged_llm import LLM, SamplingParams
from paged_llm.core.kv.paged import PagedKVCacheManager
from paged_llm.core.scheduler import SchedulerLimits
from paged_llm.kv_transfer import KVTransferConfig, as_kv_transfer_config
from paged_llm.kv_transfer.shared_storage import chain_keys


class FakeStore:
    """The scheduler side of a connector over a dict: key -> the token ids its KV holds."""

    def __init__(self, blocks: dict, can_save: bool, can_load: bool) -> None:
        self.blocks, self.can_save, self.can_load = blocks, can_save, can_load

    def block_keys(self, known, tokens, block_size, num_blocks, salt=""):
        return chain_keys(known, tokens, block_size, num_blocks, salt)

    def contains(self, key: int) -> bool:
        return key in self.blocks


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    produced=st.lists(st.tuples(st.integers(0, 2), st.integers(2, 40), st.integers(1, 3)),
                      min_size=1, max_size=8),
    consumed=st.lists(st.tuples(st.integers(0, 3), st.integers(2, 40), st.integers(1, 8)),
                      min_size=1, max_size=12),
    num_blocks=st.integers(12, 24),
    prefix_caching=st.booleans(),
    consumer_saves=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    chunk=st.sampled_from([None, 6]),
    arrivals=st.integers(1, 4),
    window=st.sampled_from([None, None, 8]),
)  # fmt: skip
def test_loaded_blocks_hold_their_tokens_and_saved_blocks_their_keys(
    produced, consumed, num_blocks, prefix_caching, consumer_saves, mode, chunk, arrivals, window
):
    store: dict[int, tuple] = {}
    limits = SchedulerLimits(
        max_num_seqs=3, max_num_batched_tokens=chunk or 48,
        enable_chunked_prefill=chunk is not None, preemption_mode=mode,
    )  # fmt: skip

    def manager(connector):
        return PagedKVCacheManager(
            num_blocks, BS, max_model_len=48, enable_prefix_caching=prefix_caching,
            num_cpu_blocks=8 if mode == "swap" else 0, sliding_window=window,
            kv_connector=connector,
        )  # fmt: skip

    run_with_shadow_pools(manager(FakeStore(store, True, False)), limits, produced, 2, store)
    saved = len(store)
    consumer = manager(FakeStore(store, consumer_saves, True))  # another engine, its own pools
    run_with_shadow_pools(consumer, limits, consumed, arrivals, store)
    assert consumer_saves or len(store) == saved  # a pure consumer never writes
    event(f"blocks loaded: {'some' if consumer.prefix_hits else 'none'}")


# ---- engines ----------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# three prompts sharing a prefix, and one that shares nothing; 16-token blocks
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (40, 77, 130)] + [
    {"prompt_token_ids": [(7 * j + 3) % 250 for j in range(50)]}
]
COMMON = dict(block_size=16, num_gpu_blocks_override=160)


def transfer(path, role: str) -> dict:
    """A SharedStorageConnector config for ``role`` over directory ``path``."""
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}  # fmt: skip


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def prefill(model, path, **kwargs) -> LLM:
    """The producer: compute each prompt and one token, saving the prompts' KV."""
    llm = LLM(model, kv_transfer_config=transfer(path, "kv_producer"), **COMMON, **kwargs)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return llm


@pytest.fixture(scope="module")
def want(tiny_llama):
    return ids(LLM(str(tiny_llama[0]), **COMMON).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_consumer_decodes_what_a_producer_prefilled(tiny_llama, want, tmp_path, prefix_caching):
    """The consumer computes only each prompt's last partial block (at least one token) and
    generates the tokens of an engine that computed everything."""
    model = str(tiny_llama[0])
    producer = prefill(model, tmp_path)
    # 2 + 4 + 8 + 3 full blocks, the shared prefix's once
    assert producer.llm_engine.kv_connector.num_saved == 2 + 2 + 4 + 3
    consumer = LLM(model, kv_transfer_config=transfer(tmp_path, "kv_consumer"),
                   enable_prefix_caching=prefix_caching, **COMMON)  # fmt: skip
    outs = consumer.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert ids(outs) == want
    assert [o.num_cached_tokens for o in outs] == [32, 64, 128, 48]
    loaded = consumer.llm_engine.kv_connector.num_loaded
    # with its prefix cache a loaded block joins the device cache at once, so the shared
    # prefix is loaded once
    assert loaded == (2 + 2 + 4 + 3 if prefix_caching else 2 + 4 + 8 + 3)
    assert consumer.llm_engine.kv_connector.num_saved == 0  # a consumer writes nothing
    again = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want[0] and again.num_cached_tokens == 32
    delta = consumer.llm_engine.kv_connector.num_loaded - loaded
    assert delta == (0 if prefix_caching else 2)  # found on the device the second time


def test_kv_both_reuses_its_own_saves_and_a_new_layout_misses(tiny_llama, want, tmp_path):
    """One engine in both roles is a persistent prefix cache; an engine with another block size
    (or weights) finds nothing of it and computes everything, still the same tokens."""
    model = str(tiny_llama[0])
    llm = LLM(model, kv_transfer_config=transfer(tmp_path, "kv_both"), **COMMON)
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert [o.num_cached_tokens for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == [
        32,
        64,
        128,
        48,
    ]
    other = LLM(model, kv_transfer_config=transfer(tmp_path, "kv_consumer"), block_size=8,
                num_gpu_blocks_override=320)  # fmt: skip
    outs = other.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert ids(outs) == want and all(o.num_cached_tokens == 0 for o in outs)
    # new weights (even the same values) make the saved KV stale: nothing is loaded
    (weights,) = tiny_llama[0].glob("*.safetensors")
    llm.llm_engine.load_weights(load_file(str(weights)).items())
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert ids(outs) == want and all(o.num_cached_tokens == 0 for o in outs)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_moves_with_its_scales(tiny_llama, tmp_path, kv_dtype):
    """A 1-byte KV cache: the scales travel with the blocks, and the consumer's tokens are
    those of an engine with the same cache that computed everything."""
    model = str(tiny_llama[0])
    q = dict(kv_cache_dtype=kv_dtype, attention_backend="torch")
    want = ids(LLM(model, **COMMON, **q).generate(PROMPTS, GREEDY, use_tqdm=False))
    prefill(model, tmp_path, **q)
    consumer = LLM(model, kv_transfer_config=transfer(tmp_path, "kv_consumer"), **COMMON, **q)
    outs = consumer.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert ids(outs) == want and outs[2].num_cached_tokens == 128


def test_a_consumer_under_preemption_and_with_a_draft_model(tiny_llama, want, tmp_path):
    """A pool too small for all four prompts (recompute preemption reloads what it can) and a
    draft model that computes its own KV of loaded blocks: the same tokens."""
    model = str(tiny_llama[0])
    prefill(model, tmp_path)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": model}
    for extra in ({"num_gpu_blocks_override": 20, "max_model_len": 160},
                  {"speculative_config": spec}):  # fmt: skip
        consumer = LLM(model, kv_transfer_config=transfer(tmp_path, "kv_consumer"),
                       **{**COMMON, **extra})  # fmt: skip
        assert ids(consumer.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        assert consumer.llm_engine.kv_connector.num_loaded >= 17


def test_files_are_per_block_and_rename_into_place(tiny_llama, tmp_path):
    model = str(tiny_llama[0])
    prefill(model, tmp_path)
    (root,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted(p.name for p in root.iterdir())
    assert len(files) == 11 and all(f.endswith(".rank0.safetensors") for f in files)
    assert not [f for f in files if f.startswith(".")]  # no temporary file left behind


@pytest.mark.parametrize(
    "config, match",
    [
        ({"kv_role": "kv_producer"}, "needs 'kv_connector'"),
        ({"kv_connector": "SharedStorageConnector", "kv_role": "prefill"}, "unknown kv_role"),
        ({"kv_connector": "SharedStorageConnector", "kv_ip": "1.2.3.4"}, "unknown kv_transfer"),
        ("SharedStorageConnector", "must be a KVTransferConfig or a mapping"),
    ],
)
def test_bad_transfer_configs_fail_before_loading(config, match):
    with pytest.raises(ValueError, match=match):
        LLM("no/such/model", kv_transfer_config=config)


def test_bad_connectors_and_policies_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown KV connector 'Nope'"):
        LLM("tiny", max_model_len=64, kv_transfer_config={"kv_connector": "Nope"})
    bad_extra = {"kv_connector": "SharedStorageConnector",
                 "kv_connector_extra_config": {"storage": str(tmp_path)}}  # fmt: skip
    with pytest.raises(ValueError, match="takes shared_storage_path"):
        LLM("tiny", max_model_len=64, kv_transfer_config=bad_extra)
    with pytest.raises(ValueError, match="needs the paged policy, not 'orca_max'"):
        LLM("tiny", max_model_len=64, policy="orca_max",
            kv_transfer_config=transfer(tmp_path, "kv_both"))  # fmt: skip
    config = KVTransferConfig("SharedStorageConnector", "kv_consumer")
    assert as_kv_transfer_config(config) is config
    assert config.is_kv_consumer and not config.is_kv_producer
    assert json.loads(json.dumps(transfer(tmp_path, "kv_both")))["kv_role"] == "kv_both"


def test_hydra_composes_a_transfer_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from paged_llm.config import engine_config_from_dict

    configs = Path(__file__).resolve().parents[1] / "configs"
    override = ("kv_transfer={kv_connector: SharedStorageConnector, kv_role: kv_consumer, "
                f"kv_connector_extra_config: {{shared_storage_path: {tmp_path}}}}}")  # fmt: skip
    with initialize_config_dir(str(configs), version_base=None):
        plain = compose("config")
        cfg = compose("config", overrides=[override])
    assert engine_config_from_dict(OmegaConf.to_container(plain)).kv_transfer_config is None
    transfer = engine_config_from_dict(OmegaConf.to_container(cfg, resolve=True)).kv_transfer_config
    assert transfer.is_kv_consumer and transfer.kv_connector_extra_config == {
        "shared_storage_path": str(tmp_path)
    }


def test_chained_keys_name_prefixes():
    a = chain_keys([], list(range(12)), 4, 3)
    b = chain_keys([], list(range(8)) + [99, 9, 10, 11], 4, 3)
    assert a[:2] == b[:2] and a[2] != b[2]  # equal prefixes, then the changed block
    assert chain_keys([], list(range(12)), 4, 3, salt="lora:1")[0] != a[0]
    assert all(k >= 2**127 for k in a)  # never a block id


def test_the_disaggregation_experiment_serves_the_same_tokens(tmp_path):
    """Three systems on one trace (separate processes): the decode engine loads every full
    prompt block the prefill engine saved and returns the colocated engine's tokens."""
    from experiments.disagg_prefill import write
    from paper_repro.common import compose

    overrides = ["checkpoint=tiny", "requests=5", "rate=5", "prompt=64", "output=6",
                 "gpu_blocks=128", "max_model_len=256"]  # fmt: skip
    cfg = compose("disagg_prefill", overrides)
    doc = write(cfg, tmp_path)
    assert json.loads((tmp_path / "disagg_prefill.json").read_text())["mode"] == "real"
    systems = doc["systems"]
    assert list(systems) == ["colocated", "colocated, chunked prefill", "disaggregated"]
    assert all(s["same_tokens_as_colocated"] for s in systems.values())
    kv = systems["disaggregated"]["kv_transfer"]
    assert kv["producer"]["blocks_saved"] > 0 and kv["consumer"]["blocks_loaded"] > 0
    assert kv["consumer"]["bytes_loaded"] == kv["consumer"]["blocks_loaded"] * (
        kv["producer"]["bytes_saved"] // kv["producer"]["blocks_saved"]
    )
    assert all(s["mean_ttft_ms"] > 0 and s["p99_itl_ms"] > 0 for s in systems.values())


def test_copies_of_a_checkpoint_share_keys_and_other_weights_do_not(tiny_llama, tmp_path):
    import shutil

    from paged_llm.kv_transfer import checkpoint_identity

    copy = shutil.copytree(tiny_llama[0], tmp_path / "copy")
    assert checkpoint_identity(copy) == checkpoint_identity(tiny_llama[0])
    (weights,) = copy.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes() + b" ")  # another size: other weights
    assert checkpoint_identity(copy) != checkpoint_identity(tiny_llama[0])


def test_a_store_that_cannot_be_written_only_loses_the_saves(tiny_llama, want, tmp_path):
    """A producer whose store path is a file (so no directory can be made there, as with a
    full or read-only disk) still serves every request; the blocks are counted as failures."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    llm = LLM(str(tiny_llama[0]), kv_transfer_config=transfer(blocked, "kv_both"), **COMMON)
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    stats = llm.llm_engine.kv_connector.stats()
    assert stats["blocks_saved"] == 0 and stats["save_failures"] == 11
