"""GPU check section ``sleep_offload`` (--extras; see experiments/gpu/): the two memory
features whose device paths only a GPU runs, checked and measured on one engine (H200 runs 5-11).

* Sleep mode at levels 1 and 2 with CUDA graphs on: the device memory in use awake, asleep and
  woken (``torch.cuda.mem_get_info``), this process's allocated and reserved bytes, the
  allocator configuration the environment sets, and the free space earlier sections left in
  segments that their live tensors pin (the bandwidth section's cuBLAS workspace does; a
  sleep-mode engine holds that space while it allocates, runner/sleep.py;
  ``experiments/gpu_sleep_probe.py`` has the breakdown), the seconds of each call, greedy
  outputs after waking
  equal to those before (level 2 after ``load_weights`` from a transformers state dict), and
  the decode graphs captured again and replayed after waking.
* The prefix cache's CPU tier: a long prompt, others that evict its blocks from a small device
  pool, the long prompt again: its cached tokens (copied back from pinned CPU memory) and the
  same greedy output.
* KV transfer (``kv_transfer_config``, docs/kv_transfer.md): a producer engine prefills the
  prompts, a consumer engine loads their blocks from ``SharedStorageConnector`` files and
  decodes: blocks moved, milliseconds per block each way, and the share of greedy tokens equal
  to the first engine's (bf16 kernels may round a loaded prefix differently from a computed one).

A transformers Llama with random weights is saved first, so the engine and the state dict
that level 2 reloads hold the same tensors. On the CPU (--smoke) the same steps run with a tiny
model, which checks the plumbing only.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.checkpoints import save_random_llama, save_tiny_llama
from experiments.common.timing import Deadline
from experiments.gpu.plans import Plan
from paged_llm.runner.sleep import pinned_cache_bytes


def _checkpoint(plan: Plan, workdir: Path) -> Path:
    """A random Llama: tiny for --smoke, ~0.5B parameters (hidden 2048, 8 layers) in bf16."""
    path = workdir / "sleep-llama"
    if plan.mode == "smoke":
        return save_tiny_llama(path)
    arch = dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192,
    )  # fmt: skip
    save_random_llama(arch, path, torch.bfloat16, seed=0)
    return path


def _used_gib(device: torch.device) -> float:
    """Device memory in use by every process (CUDA), or this process's resident memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / 2**30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _allocator_gib(device: torch.device) -> dict[str, float]:
    """This process's live tensors and the caching allocator's reservation (CUDA only)."""
    if device.type != "cuda":
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device) / 2**30,
        "reserved": torch.cuda.memory_reserved(device) / 2**30,
    }


def alloc_conf_env() -> dict[str, str]:
    """The allocator configuration the environment sets (the new variable name, the old)."""
    return {v: os.environ[v] for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
            if v in os.environ}  # fmt: skip


def _timed(fn: Any, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(time.perf_counter() - start, 4)


def section_sleep_offload(
    plan: Plan, device: torch.device, deadline: Deadline, workdir: Path
) -> dict[str, Any]:
    """Sleep levels 1 and 2 and the CPU tier on one engine; see the module docstring."""
    from safetensors.torch import load_file

    from paged_llm import LLM, SamplingParams

    smoke = plan.mode == "smoke"
    path = _checkpoint(plan, workdir)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    # a small pool, so the tier has work to do (the tiny model has 128 positions)
    block, pool = (4, 24) if smoke else (16, 512)
    # free space earlier sections left in segments live tensors pin: the engine may take it,
    # and a sleep cannot hand that back (paged_llm/runner/sleep.py)
    pinned = pinned_cache_bytes(device) / 2**30
    llm = LLM(
        str(path), device=str(device), dtype="float32" if smoke else "bfloat16",
        enable_sleep_mode=True, enable_prefix_caching=True, block_size=block,
        num_gpu_blocks_override=pool, max_model_len=pool * block, max_num_seqs=16,
        kv_offloading_size=0.01 if smoke else 4.0, seed=0,
    )  # fmt: skip
    engine = llm.llm_engine
    vocab = engine.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=8 if smoke else 64, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % vocab for j in range(16 + 8 * i)]}
               for i in range(8)]  # fmt: skip

    def outputs(batch: list[dict] = prompts) -> list[Any]:
        return llm.generate(batch, greedy, use_tqdm=False)

    want = [o.outputs[0].token_ids for o in outputs()]
    result: dict[str, Any] = {
        "model": str(path.name), "graph_sizes": engine.runner.graph_sizes,
        "pinned_cache_GiB_before_engine": pinned,
        "alloc_conf_env": alloc_conf_env(),
    }  # fmt: skip
    levels = []
    for level in (1, 2):
        if deadline.left() < 5:
            result["stopped"] = f"deadline before level {level}"
            break
        row: dict[str, Any] = {"level": level, "used_GiB_awake": _used_gib(device)}
        awake = _allocator_gib(device)
        row["sleep_s"] = _timed(lambda lv=level: llm.sleep(lv), device)
        row["used_GiB_asleep"] = _used_gib(device)
        for key, value in awake.items():  # live tensors vs reserved: unfreed, cached or returned
            row[f"{key}_GiB_awake"], row[f"{key}_GiB_asleep"] = value, _allocator_gib(device)[key]
        row["wake_weights_s"] = _timed(lambda: llm.wake_up(tags=["weights"]), device)
        if level == 2:
            row["load_weights_s"] = _timed(lambda: llm.load_weights(state.items()), device)
        row["wake_kv_cache_s"] = _timed(lambda: llm.wake_up(tags=["kv_cache"]), device)
        row["used_GiB_woken"] = _used_gib(device)
        graphs = engine.runner.forward_kinds["graph"]
        row["same_outputs"] = [o.outputs[0].token_ids for o in outputs()] == want
        row["graphs_replayed_after_waking"] = engine.runner.forward_kinds["graph"] > graphs
        row["freed_GiB"] = round(row["used_GiB_awake"] - row["used_GiB_asleep"], 3)
        levels.append(row)
    result["levels"] = levels
    if deadline.left() > 5:
        long = {"prompt_token_ids": [(13 * j + 5) % vocab for j in range(pool * block // 2)]}
        first = outputs([long])[0]
        others = [{"prompt_token_ids": [(17 * i + 3 * j + 1) % vocab for j in range(pool * 3)]}
                  for i in range(6)]  # fmt: skip
        for other in others:  # one at a time: each fills most of the pool
            outputs([other])
        again = outputs([long])[0]
        tier = engine.scheduler.kv.offload
        result["offload"] = {
            "prompt_tokens": len(long["prompt_token_ids"]),
            "cached_tokens": again.num_cached_tokens,
            "blocks_copied_out": tier.num_saved,
            "blocks_copied_back": tier.num_loaded,
            "same_output": again.outputs[0].token_ids == first.outputs[0].token_ids,
        }
    graphs_back = (
        all(r["graphs_replayed_after_waking"] for r in levels) or not result["graph_sizes"]
    )
    result["all_pass"] = (
        all(r["same_outputs"] for r in levels)
        and graphs_back
        and (
            result.get("offload", {}).get("same_output", False)
            and result["offload"]["cached_tokens"] > 0
        )
    )
    llm.shutdown()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if deadline.left() > 20:
        common = dict(device=str(device), dtype="float32" if smoke else "bfloat16",
                      block_size=block, num_gpu_blocks_override=pool,
                      max_model_len=pool * block, seed=0)  # fmt: skip
        result["kv_transfer"] = _kv_transfer(path, workdir, common, prompts, greedy, want)
        result["all_pass"] = result["all_pass"] and result["kv_transfer"]["pass"]
    return result


def _kv_transfer(path: Path, workdir: Path, common: dict, prompts: list, greedy: Any,
                 want: list[list[int]]) -> dict[str, Any]:  # fmt: skip
    """A producer prefills ``prompts``, a consumer loads their KV and decodes; what moved,
    how fast, and how many greedy tokens equal ``want``."""
    from paged_llm import LLM, SamplingParams

    store = {"shared_storage_path": str(workdir / "kv")}

    def transfer(role: str) -> dict[str, Any]:
        return {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": store}  # fmt: skip

    out: dict[str, Any] = {}
    for role in ("kv_producer", "kv_consumer"):
        llm = LLM(str(path), kv_transfer_config=transfer(role), **common)
        if role == "kv_producer":
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        else:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        out[role] = llm.llm_engine.kv_connector.stats()
        llm.shutdown()
        del llm
        gc.collect()
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    out["tokens_agree"] = sum(a == b for a, b in pairs) / max(1, len(pairs))
    block = common["block_size"]
    expected = sum((len(p["prompt_token_ids"]) - 1) // block for p in prompts)
    for role, verb in (("kv_producer", "saving"), ("kv_consumer", "loading")):
        n = out[role]["blocks_saved" if verb == "saving" else "blocks_loaded"]
        out[f"ms_per_block_{verb}"] = 1000 * out[role][f"seconds_{verb}"] / max(1, n)
    # (a small pool preempts, and a recomputed request loads its blocks again)
    out["pass"] = out["kv_consumer"]["blocks_loaded"] >= expected and out["tokens_agree"] >= 0.95
    return out
