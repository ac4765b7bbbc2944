"""The workload of the speculative-decoding experiments, without Hydra (the GPU check imports it
on a machine that has none): the built-in models by name, held-out code prompts, and timed
greedy runs."""

from __future__ import annotations

import time
from pathlib import Path

from paged_llm import LLM, SamplingParams


def model_dir(name: str) -> str:
    """A built-in trained model by name, or a checkpoint directory as given."""
    if Path(name).is_dir():
        return name
    from paged_llm.models.trained import trained_model_dir

    return str(trained_model_dir(name))


def code_prompts(target: str, num: int, length: int) -> list[list[int]]:
    """Prompts cut from held-out standard-library source the models were not trained on, in the
    tokenizer of the built-in ``target`` (a checkpoint directory uses the default target's)."""
    from paged_llm.models.trained import corpus_tokens

    name = "target" if Path(target).is_dir() else target
    ids = [int(t) for t in corpus_tokens(name, "heldout")]
    stride = max(length, len(ids) // (num + 1))
    return [ids[i * stride : i * stride + length] for i in range(num)]


def prompt_batches(pool: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Every prompt of the pool once, in batches of ``batch_size`` (a batch larger than the pool
    repeats it). All batch sizes thus generate from the same prompts, and batch 1 is not one
    prompt's luck."""
    if batch_size >= len(pool):
        return [(pool * (batch_size // len(pool) + 1))[:batch_size]]
    return [pool[i : i + batch_size] for i in range(0, len(pool) - batch_size + 1, batch_size)]


def generate_greedy(llm: LLM, batches: list[list[list[int]]], max_tokens: int) -> list[list[int]]:
    """Each output's token ids, the batches run one after another, each a greedy ``generate``
    call that ignores EOS."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    for prompts in batches:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs += [o.outputs[0].token_ids for o in outs]
    return outputs


def timed_run(
    llm: LLM, batches: list[list[list[int]]], max_tokens: int, repeats: int = 1
) -> tuple[float, int]:
    """Seconds (the fastest of ``repeats``) and output tokens of ``generate_greedy``."""
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = sum(len(ids) for ids in generate_greedy(llm, batches, max_tokens))
        best = min(best, time.perf_counter() - start)
    return best, tokens


def forwards_since(llm: LLM, before: dict[str, int]) -> dict[str, int]:
    """How the target's forwards ran since ``before`` (a copy of the runner's
    ``forward_kinds``): graph replays and eager forwards by kind, those that happened."""
    now = llm.llm_engine.runner.forward_kinds
    return {kind: n - before.get(kind, 0) for kind, n in now.items() if n > before.get(kind, 0)}
