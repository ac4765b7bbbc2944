"""An RL loop end to end, the way RLHF frameworks drive vLLM: the engine samples groups of
completions, sleeps while a transformers copy of the policy takes a GRPO step, then wakes,
takes the new weights (``load_weights``) and samples again.

Each step also checks what such a loop depends on: the log-probabilities the engine reported
for its samples equal the trainer's for the same tokens under the same weights (a mismatch
biases every policy-gradient step). The task is a toy one so that any model learns it in a few
steps: the reward is the fraction of completion tokens from a fixed set of token ids.

    python -m experiments.rl_loop [checkpoint=DIR] [steps=20] [group=8] [prompts=4] [max_tokens=16]
        [lr=1e-2] [sleep_level=2]    # configs/rl_loop.yaml; JSON in the Hydra run directory
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common.cli import hydra_app, settings
from paged_llm import LLM, SamplingParams
from paged_llm.metrics.run_info import run_info, write_json
from paged_llm.models.presets import default_model_dir

# completion-token ids the reward counts: the first REWARDED of the vocabulary
REWARDED = 64


def reward(token_ids: list[int]) -> float:
    """The fraction of ``token_ids`` below REWARDED."""
    return sum(t < REWARDED for t in token_ids) / max(len(token_ids), 1)


def trainer_logprobs(policy: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion token | everything before it) under ``policy``, one per token [T]."""
    ids = torch.tensor([prompt + completion])
    logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def grpo_step(policy: Any, optimizer: Any, groups: list[tuple[list[int], list[Any]]]) -> dict:
    """One GRPO update (on-policy, so the ratio is 1): advantages are rewards normalised within
    each prompt's group; returns the engine-vs-trainer log-probability gap measured before it."""
    optimizer.zero_grad()
    gaps, loss, count = [], torch.zeros(()), 0
    for prompt, samples in groups:
        rewards = [reward(s.token_ids) for s in samples]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for s, r in zip(samples, rewards):
            lp = trainer_logprobs(policy, prompt, list(s.token_ids))
            engine_lp = torch.tensor([e[t].logprob for e, t in zip(s.logprobs, s.token_ids)])
            gaps.append((lp.detach() - engine_lp).abs().max().item())
            loss = loss - (r - mean) / (std + 1e-4) * lp.mean()
            count += 1
    (loss / count).backward()
    optimizer.step()
    return {"logprob_gap_max": max(gaps), "logprob_gap_mean": statistics.fmean(gaps)}


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run it with the config's settings; write rl_loop.json into out_dir; return it."""
    args = settings(cfg)
    import transformers

    path = args.checkpoint or str(default_model_dir())
    torch.manual_seed(args.seed)
    llm = LLM(path, enable_sleep_mode=args.sleep_level > 0, cpu_kv_cache_gib=0.05, seed=args.seed)
    policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    vocab = llm.llm_engine.vocab_size
    prompts = [[(97 * i + 13 * j) % vocab for j in range(8)] for i in range(args.prompts)]
    rows = []
    for step in range(args.steps):
        times = {}
        start = time.perf_counter()
        params = SamplingParams(n=args.group, temperature=1.0, max_tokens=args.max_tokens,
                                ignore_eos=True, logprobs=0, seed=args.seed + step)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        times["generate_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if args.sleep_level:
            llm.sleep(args.sleep_level)
        times["sleep_s"] = time.perf_counter() - start
        start = time.perf_counter()
        groups = [(q, o.outputs) for q, o in zip(prompts, outs)]
        mean_reward = statistics.fmean(reward(s.token_ids) for _, g in groups for s in g)
        gap = grpo_step(policy, optimizer, groups)
        times["train_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if args.sleep_level:
            llm.wake_up(tags=["weights"])
        llm.load_weights(policy.state_dict().items())
        if args.sleep_level:
            llm.wake_up(tags=["kv_cache"])
        times["sync_s"] = time.perf_counter() - start
        rows.append({"step": step, "mean_reward": mean_reward, **gap, **times})
        print(f"step {step:3d}: reward {mean_reward:.3f}, logprob gap max "
              f"{gap['logprob_gap_max']:.2e}", flush=True)  # fmt: skip
    doc = {
        **run_info("real", str(llm.llm_engine.device)),
        "model": path,
        "settings": vars(args),
        "reward": f"fraction of completion tokens with id < {REWARDED}",
        "steps": rows,
        "notes": "mean_reward is of the samples drawn at the start of each step (before its "
        "update); logprob_gap is |trainer - engine| log p of the sampled tokens under the "
        "same weights, per sample the largest over its tokens",
    }
    print(f"wrote {write_json(out_dir, 'rl_loop.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.rl_loop [key=value ...]`` (configs/rl_loop.yaml)."""
    hydra_app("rl_loop", write)


if __name__ == "__main__":
    main()
