"""What sleep mode frees and what it costs: for levels 1 and 2, the engine's memory (weights and
KV pools, by their storages) and the process's resident memory (or, on CUDA, the device's)
awake, asleep and woken again; the seconds to sleep, to wake the weights, to write new weights
(level 2, an RL weight sync from a transformers copy) and to wake the KV cache. The peer, in the
same run: building a fresh engine from the checkpoint, which is what sleep mode saves. Greedy
outputs after each wake are checked against the outputs before.

    python -m experiments.sleep_mode [engine_device=auto] [kv_gib=1.0] [hidden=768] [layers=12]
        # configs/sleep_mode.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.cli import hydra_app, settings
from paged_llm import LLM, SamplingParams
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.recipes.cache import cache_root

GIB = 2**30
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 33, 2, 9, 11, 40 + i]} for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def checkpoint(hidden: int, layers: int) -> tuple[Path, Any]:
    """A random transformers Llama of this size, saved once under the cache; (dir, model)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    key = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:12]
    path = cache_root() / f"sleep-mode-llama-{key}"
    if not (path / "config.json").is_file():
        model.save_pretrained(str(path))
    return path, model


def _rank_bytes(runner: Any) -> tuple[int, int]:
    weights = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in [*runner.model.parameters(), *runner.model.buffers()]}  # fmt: skip
    pools = sum(t.untyped_storage().nbytes() for pair in runner.kv_caches for t in pair)
    return sum(weights.values()), pools


def memory(llm: LLM) -> dict[str, float]:
    """GiB of the engine's weights and KV (storages still allocated), and of the process's
    resident memory (CPU) or the device's allocated and reserved memory (CUDA)."""
    weights, pools = llm.collective_rpc(_rank_bytes)[0]
    out = {"engine_weights_gib": weights / GIB, "engine_kv_gib": pools / GIB}
    if llm.llm_engine.device.type == "cuda":
        out["cuda_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        out["cuda_reserved_gib"] = torch.cuda.memory_reserved() / GIB
        free, total = torch.cuda.mem_get_info()
        out["cuda_used_gib"] = (total - free) / GIB
    else:
        with open("/proc/self/statm") as f:
            out["process_rss_gib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    return out


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def seconds(fn: Any) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def one_level(llm: LLM, level: int, weights: dict[str, torch.Tensor], want: Any) -> dict:
    """Sleep at ``level``, wake weights, (level 2: load them), wake the KV; what each cost."""
    row: dict[str, Any] = {"level": level, "memory_awake": memory(llm)}
    row["sleep_s"] = seconds(lambda: llm.sleep(level))
    row["memory_asleep"] = memory(llm)
    row["wake_weights_s"] = seconds(lambda: llm.wake_up(tags=["weights"]))
    if level == 2:
        row["load_weights_s"] = seconds(lambda: llm.load_weights(weights.items()))
    row["wake_kv_cache_s"] = seconds(lambda: llm.wake_up(tags=["kv_cache"]))
    row["memory_woken"] = memory(llm)
    row["same_outputs"] = outputs(llm) == want
    return row


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write sleep_mode.json into out_dir; return it."""
    args = settings(cfg)
    path, hf = checkpoint(args.hidden, args.layers)
    kwargs = dict(device=args.engine_device, cpu_kv_cache_gib=args.kv_gib, max_model_len=2048,
                  gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    # the peer: a fresh engine from the checkpoint (the faster of two: the first also pays
    # one-time imports and the CPU kernel's load)
    build_s = min(seconds(lambda: LLM(str(path), **kwargs).shutdown()) for _ in range(2))
    llm = LLM(str(path), enable_sleep_mode=True, **kwargs)
    want = outputs(llm)
    weights = {n: t.to(llm.llm_engine.device) for n, t in hf.state_dict().items()}
    levels = [one_level(llm, level, weights, want) for level in (1, 2)]
    engine = llm.llm_engine
    device = str(engine.device)
    doc = {
        **run_info("real", device),
        "model": {
            "dir": str(path),
            "hidden": args.hidden,
            "layers": args.layers,
            "parameters": sum(t.numel() for t in hf.parameters()),
        },  # fmt: skip
        "kv_cache_tokens": engine.kv_cache_tokens,
        "fresh_engine_s": build_s,
        "levels": levels,
        "notes": "memory in GiB; engine_* count the storages of the model's tensors and the KV "
        "pools; on a CPU device level 1 keeps the weights in place (they are host memory); "
        "fresh_engine_s builds a new engine from the checkpoint on disk (page cache warm), "
        "faster of two",
    }
    out = write_json(out_dir, "sleep_mode.json", doc)
    for row in levels:
        print(
            f"level {row['level']}: sleep {row['sleep_s']:.3f} s, wake weights "
            f"{row['wake_weights_s']:.3f} s, load {row.get('load_weights_s', 0):.3f} s, wake KV "
            f"{row['wake_kv_cache_s']:.3f} s; memory awake/asleep/woken "
            f"{_total(row['memory_awake']):.2f}/{_total(row['memory_asleep']):.2f}/"
            f"{_total(row['memory_woken']):.2f} GiB; same outputs: {row['same_outputs']}"
        )
    print(f"fresh engine: {build_s:.2f} s; wrote {out}")
    return doc


def _total(m: dict[str, float]) -> float:
    return m["engine_weights_gib"] + m["engine_kv_gib"]


def main() -> None:
    """``python -m experiments.sleep_mode [key=value ...]`` (configs/sleep_mode.yaml)."""
    hydra_app("sleep_mode", write)


if __name__ == "__main__":
    main()
