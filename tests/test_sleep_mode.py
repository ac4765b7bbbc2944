"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``) and calls on every rank (``collective_rpc``,
``apply_model``). Sleeping frees the memory it says it frees; after waking, generation equals
generation before the sleep (level 1) or transformers' with the weights loaded again (level 2);
what a sleep must keep (buffers, LoRA slots, a draft model) survives it; every misuse is a
clear error that changes nothing. Tensor-parallel ranks: tests/test_tensor_parallel.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_engine import generate_ids, hf_greedy
from test_load_weights import trained_step
from test_models import _hf_model, _save

from paged_llm import LLM, SamplingParams
from paged_llm.engine import worker as engine_worker
from paged_llm.engine.loading import checkpoint_path
from paged_llm.engine.sleep_mode import EngineAsleepError, describe
from paged_llm.runner.sleep import (
    HeldFreeSpace,
    SleepingMemory,
    SleepReport,
    free_blocks_to_hold,
    hold_blocks,
    pinned_cache_bytes,
)

PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())  # fmt: skip


def kv_bytes(engine) -> int:
    return storage_bytes(t for pair in engine.runner.kv_caches for t in pair)


def param_bytes(engine) -> int:
    return storage_bytes(engine.model.parameters())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = _hf_model("llama-gqa")
    return str(_save(hf, tmp_path_factory.mktemp("sleep-llama"))), hf


def sleepy(path, **kw):
    return LLM(path, enable_sleep_mode=True, block_size=4, cpu_kv_cache_gib=0.01, **kw)


def test_level_1_frees_the_kv_cache_and_wakes_to_the_same_outputs(llama):
    path, hf = llama
    llm = sleepy(path, enable_prefix_caching=True)
    engine = llm.llm_engine
    before = generate_ids(llm, PROMPTS, 8)
    assert before == [hf_greedy(hf, p, 8) for p in PROMPTS]
    kv, params = kv_bytes(engine), param_bytes(engine)
    llm.sleep(level=1)
    assert engine.is_sleeping() and kv_bytes(engine) == 0
    assert param_bytes(engine) == params  # on a CPU device "offloaded" weights stay in place
    with pytest.raises(EngineAsleepError, match=r"asleep \(weights, kv_cache.*wake_up"):
        generate_ids(llm, PROMPTS, 2)
    assert not engine.has_unfinished_requests()  # the refused prompts left nothing queued
    llm.wake_up()
    assert not engine.is_sleeping() and kv_bytes(engine) == kv
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == before
    assert [o.num_cached_tokens for o in outs] == [0, 0]  # the prefix cache went with the KV


def test_level_2_discards_the_weights_for_load_weights_to_write(llama):
    path, hf = llama
    llm = sleepy(path)
    engine = llm.llm_engine
    buffers = storage_bytes(engine.model.buffers())
    llm.sleep(level=2)
    assert param_bytes(engine) == 0 and kv_bytes(engine) == 0
    assert storage_bytes(engine.model.buffers()) == buffers > 0  # rotary tables are kept
    new_model, changed = trained_step(hf, [""])  # every tensor moved, as by an RL step
    with pytest.raises(ValueError, match=r"wake_up\(tags=\['weights'\]\)"):
        llm.load_weights(changed.items())
    # the RL order: wake the weights, write new ones, then give the KV cache its memory back
    llm.wake_up(tags=["weights"])
    assert engine.is_sleeping() and kv_bytes(engine) == 0
    llm.load_weights(list(changed.items())[:3])
    llm.wake_up(tags=["kv_cache"])
    assert not engine.is_sleeping()
    with pytest.raises(EngineAsleepError, match="load_weights has not written"):
        generate_ids(llm, PROMPTS, 2)  # most parameters are still the zeros waking gave them
    llm.load_weights(changed.items())
    assert generate_ids(llm, PROMPTS, 8) == [hf_greedy(new_model, p, 8) for p in PROMPTS]


def test_misuse_is_refused_and_changes_nothing(llama):
    path, _ = llama
    off = LLM(path, cpu_kv_cache_gib=0.01)
    for call in (off.sleep, off.wake_up):
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            call()
    llm = sleepy(path)
    engine = llm.llm_engine
    before = generate_ids(llm, PROMPTS, 6)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            llm.sleep(level)
    engine.add_request("running", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="between requests"):
        llm.sleep()
    engine.abort_request("running")
    llm.wake_up()  # waking an engine that is awake does nothing
    llm.sleep(1)
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(2)
    with pytest.raises(ValueError, match="unknown sleep tag"):
        llm.wake_up(tags=["weight"])
    assert engine.sleep_state.asleep == {"weights", "kv_cache"}
    llm.wake_up(tags="kv_cache")  # one tag as a string, as vLLM takes it too
    llm.wake_up()
    assert generate_ids(llm, PROMPTS, 6) == before
    quantized = sleepy(path, quantization="int8")
    expected = generate_ids(quantized, PROMPTS, 6)
    with pytest.raises(ValueError, match="quantized model cannot take load_weights"):
        quantized.sleep(2)
    quantized.sleep(1)  # the int8 weights are buffers: offloaded, never discarded
    quantized.wake_up()
    assert generate_ids(quantized, PROMPTS, 6) == expected


def test_a_draft_model_sleeps_with_the_target():
    """The draft's KV pool is discarded with the target's; its weights, which load_weights
    never writes, are kept even at level 2."""
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}
    llm = LLM("tiny", enable_sleep_mode=True, speculative_config=spec, cpu_kv_cache_gib=0.01)
    engine, drafter = llm.llm_engine, llm.llm_engine.drafter
    before = generate_ids(llm, PROMPTS, 10)
    draft_weights = storage_bytes(drafter.model.parameters())
    llm.sleep(2)
    assert storage_bytes(t for pair in drafter.kv_caches for t in pair) == 0
    assert storage_bytes(drafter.model.parameters()) == draft_weights
    llm.wake_up()
    llm.load_weights(load_file(checkpoint_path("tiny") / "model.safetensors").items())
    assert generate_ids(llm, PROMPTS, 10) == before
    assert engine.spec_stats.num_accepted_tokens > 0


def test_lora_adapters_survive_a_level_2_sleep(tiny_llama, tmp_path):
    pytest.importorskip("peft")
    from test_lora import write_adapter

    from paged_llm.lora.request import LoRARequest

    base_dir, base = tiny_llama
    write_adapter(base_dir, tmp_path / "lora", ["q_proj", "down_proj"], r=4, alpha=8, seed=2)
    lora = LoRARequest("a", 1, str(tmp_path / "lora"))
    llm = LLM(str(base_dir), enable_sleep_mode=True, enable_lora=True, max_lora_rank=8,
              cpu_kv_cache_gib=0.01)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy,
                            use_tqdm=False, lora_request=lora)  # fmt: skip
        return [o.outputs[0].token_ids for o in outs]

    before = run()
    llm.sleep(2)
    llm.wake_up()
    llm.load_weights(base.state_dict().items())  # the base weights only: the slots kept theirs
    assert run() == before


def test_collective_rpc_and_apply_model_run_on_the_runner(llama):
    path, _ = llama
    llm = LLM(path, block_size=4, cpu_kv_cache_gib=0.01)
    numel = sum(p.numel() for p in llm.llm_engine.model.parameters())
    assert llm.apply_model(lambda model: sum(p.numel() for p in model.parameters())) == [numel]
    assert llm.collective_rpc(lambda runner, x: runner.block_size * x, args=(3,)) == [12]
    assert llm.collective_rpc("apply_model", kwargs={"func": type}) == [type(llm.llm_engine.model)]
    for bad in ("nope", "_forward", "block_size"):
        with pytest.raises(ValueError, match=f"no public method '{bad}'"):
            llm.collective_rpc(bad)
    with pytest.raises(ValueError, match="timeout"):
        llm.collective_rpc("apply_model", timeout=1.0, args=(type,))


# ---- the storage mechanics, on random tensor sets -----------------------------------------
@st.composite
def tensor_sets(draw):
    """Base tensors, views of them (as tied weights and fused q/k/v share storage), and for
    each one whether it is kept or discarded."""
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    bases = [torch.randn(n) for n in sizes]
    views = []  # (index of its base, the view)
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(bases) - 1))
        views.append((i, bases[i][draw(st.integers(0, bases[i].numel() - 1)) :]))
    tensors = bases + [v for _, v in views]
    keep = draw(st.lists(st.booleans(), min_size=len(tensors), max_size=len(tensors)))
    return tensors, views, keep, draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(case=tensor_sets())
def test_storages_are_freed_once_and_restored_by_rule(case):
    tensors, views, keep, offload_host = case
    originals = [t.clone() for t in tensors]
    storage_of = [t.untyped_storage().data_ptr() for t in tensors]
    kept_storages = {s for s, k in zip(storage_of, keep) if k}
    sizes = {s: t.untyped_storage().nbytes() for s, t in zip(storage_of, tensors)}
    memory = SleepingMemory.release(
        [t for t, k in zip(tensors, keep) if k],
        [t for t, k in zip(tensors, keep) if not k],
        offload_host=offload_host,
    )
    released = {s for s in sizes if s not in kept_storages or offload_host}
    assert memory.freed_bytes == sum(sizes[s] for s in released)
    assert memory.offloaded_bytes == sum(sizes[s] for s in released & kept_storages)
    for t, s in zip(tensors, storage_of):
        assert t.untyped_storage().nbytes() == (0 if s in released else sizes[s])
    memory.restore()
    for t, s, want in zip(tensors, storage_of, originals):
        # a storage any kept tensor shares comes back whole; one only discarded comes back zero
        assert torch.equal(t, want if s in kept_storages else torch.zeros_like(want))
    for i, view in views:  # a view still aliases its base after the storage was re-created
        tensors[i].fill_(7.0)
        assert bool((view == 7.0).all())


@pytest.mark.parametrize(("pinned_mib", "warns"), [(0, False), (63, False), (512, True)])
def test_a_sleep_mode_engine_warns_when_cached_cuda_memory_is_pinned(
    monkeypatch, caplog, pinned_mib, warns
):
    # cached space inside segments live tensors use cannot go back to the driver (run 8 probe)
    monkeypatch.setattr(engine_worker, "pinned_cache_bytes", lambda device: pinned_mib * 2**20)
    with caplog.at_level("WARNING", logger=engine_worker.logger.name):
        held = engine_worker._hold_pinned_free_space(torch.device("cuda"))
    assert ("expandable_segments:True" in caplog.text) is warns
    assert held.nbytes == 0  # CUDA never initialised here: nothing to hold
    assert pinned_cache_bytes(torch.device("cpu")) == 0


def test_placeholders_cover_free_blocks_of_pinned_large_default_pool_segments_only():
    def seg(blocks, **kw):
        base = {"segment_type": "large", "segment_pool_id": (0, 0), "stream": 0,
                "is_expandable": False}  # fmt: skip
        return {**base, **kw, "blocks": [{"size": n, "state": st} for n, st in blocks]}

    live, free = "active_allocated", "inactive"
    segments = [
        seg([(32, live), (992, free)]),  # a cuBLAS workspace pinning a freed copy buffer
        seg([(8, live), (24, free), (4, live), (12, free)]),
        seg([(8, live), (56, free)], is_expandable=True),  # unmaps its free pages itself
        seg([(1, live), (1, free)], segment_type="small"),
        seg([(8, live), (8, free)], segment_pool_id=(1, 0)),  # a CUDA graph's private pool
        seg([(8, live), (8, free)], stream=7),  # the engine allocates on the current stream
    ]
    assert free_blocks_to_hold(segments, stream=0) == [992, 24, 12]
    assert HeldFreeSpace(torch.device("cpu")).nbytes == 0


def test_a_placeholder_that_needs_a_new_segment_is_dropped():
    reserved, holes = [1000], [992, 12]  # reserved bytes; free blocks the allocator can reuse

    def allocate(n):
        if n == 7:
            raise torch.OutOfMemoryError("no room")
        if n in holes:
            holes.remove(n)
        else:  # best-fit found no hole: the allocator reserves a new segment
            reserved[0] += n
        return torch.empty(n, dtype=torch.uint8)

    kept, grew = hold_blocks([992, 24, 7, 12], allocate, lambda: reserved[0])
    assert [t.numel() for t in kept] == [992, 12] and grew
    kept, grew = hold_blocks([], allocate, lambda: reserved[0])
    assert kept == [] and not grew


def test_the_sleep_log_says_what_the_driver_got_back_where_it_knows():
    cpu = describe([SleepReport(freed=2**30, offloaded=2**29)], "cpu")
    assert "1.000 GiB" in cpu and "driver" not in cpu
    cuda = describe([SleepReport(2**30, 0, returned=2**29), SleepReport(2**30, 0, returned=0)],
                    "cuda")  # fmt: skip
    assert "2 rank(s)" in cuda and "the driver got 0.500 GiB back" in cuda


def test_the_experiment_measures_both_levels(tmp_path):
    from experiments.sleep_mode import write
    from paper_repro.common import compose

    doc = write(compose("sleep_mode", ["hidden=64", "layers=1", "kv_gib=0.01"]), tmp_path)
    assert doc["mode"] == "real" and doc["hardware"]["device"] == "cpu"
    assert (tmp_path / "sleep_mode.json").is_file() and doc["fresh_engine_s"] > 0
    for row in doc["levels"]:
        awake, asleep = row["memory_awake"], row["memory_asleep"]
        assert row["same_outputs"] and asleep["engine_kv_gib"] == 0 < awake["engine_kv_gib"]
        assert row["memory_woken"]["engine_kv_gib"] == awake["engine_kv_gib"]
        weights_left = asleep["engine_weights_gib"]
        if row["level"] == 1:
            assert weights_left == awake["engine_weights_gib"]  # CPU: left in place
        else:
            assert weights_left < 0.01 * awake["engine_weights_gib"]  # buffers only


def test_an_rl_loop_learns_and_the_engine_agrees_with_the_trainer(tmp_path):
    """experiments/rl_loop.py: sample, sleep, GRPO step on a transformers copy, wake, load the
    weights, repeat. Every step the engine's logprobs of its samples equal the trainer's under
    the same weights; the reward rises; and sleeping changes nothing (the same run without it
    draws the same samples)."""
    from experiments.rl_loop import write
    from paper_repro.common import compose

    args = ["steps=6", "group=4", "prompts=2"]
    slept = write(compose("rl_loop", [*args, "sleep_level=2"]), tmp_path)["steps"]
    awake = write(compose("rl_loop", [*args, "sleep_level=0"]), tmp_path)["steps"]
    assert all(row["logprob_gap_max"] < 1e-4 for row in slept)
    rewards = [r["mean_reward"] for r in slept]
    assert sum(rewards[-2:]) > sum(rewards[:2])
    assert rewards == [r["mean_reward"] for r in awake]
