"""Hugging Face transformers baselines for the throughput benchmark.

Two ways transformers serves a batch of requests:

* ``generate`` with static batches: requests are cut into fixed batches in workload order,
  left-padded, and every batch runs until its longest output is done (what vLLM's
  ``benchmark_throughput --backend hf`` measures).
* continuous batching (the engine behind ``model.generate_batch``): a paged KV cache and a
  scheduler that admits and retires requests every step, like this project's engine.

Both run greedy decoding with EOS disabled, so they generate exactly the requested lengths and
their tokens can be compared one-for-one with the paged engine's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from experiments.common.timing import Deadline, Timer

logger = logging.getLogger(__name__)
CB_LOGGER = "ContinuousBatchingLogger"  # transformers' continuous batching logs here


class _DropPsutilNoise(logging.Filter):
    """Drop the "install psutil" messages: they concern memory auto-sizing, and every size
    is given explicitly here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


@contextlib.contextmanager
def quiet_cb_logs() -> Iterator[None]:
    """Show only warnings and errors of transformers' continuous batching, minus psutil noise."""
    cb_logger = logging.getLogger(CB_LOGGER)
    level, noise = cb_logger.level, _DropPsutilNoise()
    cb_logger.setLevel(logging.WARNING)
    cb_logger.addFilter(noise)
    try:
        yield
    finally:
        cb_logger.setLevel(level)
        cb_logger.removeFilter(noise)


@dataclass
class SystemRun:
    """What one system produced: times, per-request outputs and the tokens it generated."""

    elapsed_s: float
    cpu_s: float
    outputs: list[list[int]]  # each request's first output_len generated tokens, in order
    generated_tokens: int  # all tokens decoded, including those past a request's own length
    notes: list[str]
    settings: dict[str, Any]


def load_hf_model(path: str, dtype: torch.dtype) -> Any:
    """Load the checkpoint with transformers' own model class, in eval mode (on the CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy_config(max_new_tokens: int, pad_token_id: int) -> Any:
    """Greedy, EOS-free settings: runs exactly max_new_tokens steps, bans no token."""
    from transformers import GenerationConfig

    # eos_token_id=-1 matches no token, so nothing stops early; unlike min_new_tokens it does
    # not mask EOS out of the logits, which would make greedy choices differ from ignore_eos.
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def _left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into (input_ids, attention_mask), so every row's last token is aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def generate_static_batch(
    model: Any, prompts: Sequence[list[int]], output_lens: Sequence[int], pad_id: int = 0
) -> tuple[list[list[int]], int]:
    """One static batch through ``model.generate``; return (per-request outputs, tokens decoded)."""
    ids, mask = (t.to(model.device) for t in _left_pad(prompts, pad_id))
    steps = max(output_lens)  # a static batch runs until its longest request is done
    config = greedy_config(steps, pad_id)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new = out[:, ids.shape[1] :].tolist()
    return [row[:n] for row, n in zip(new, output_lens)], steps * len(prompts)


def run_static_generate(
    model: Any,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    batch_size: int,
    pad_id: int = 0,
) -> SystemRun:
    """All requests through ``generate`` in fixed batches of batch_size, in workload order."""
    outputs: list[list[int]] = []
    generated = 0
    with Timer() as timer:
        for lo in range(0, len(prompts), batch_size):
            hi = lo + batch_size
            batch_out, batch_generated = generate_static_batch(
                model, prompts[lo:hi], output_lens[lo:hi], pad_id
            )
            outputs.extend(batch_out)
            generated += batch_generated
    notes = [
        "static batches in workload order (no sorting by length), left padding, greedy",
        "each batch decodes max(output_len) of its requests; only each request's own "
        "output_len tokens count as output",
    ]
    settings = {"batch_size": batch_size, "attn_implementation": _attn_impl(model)}
    return SystemRun(timer.wall_s, timer.cpu_s, outputs, generated, notes, settings)


def _attn_impl(model: Any) -> str:
    return str(getattr(model.config, "_attn_implementation", "unknown"))


def cb_page_size(cb_config: Any) -> int:
    """Tokens per KV page of a ContinuousBatchingConfig (named block_size before 5.2x)."""
    return getattr(cb_config, "page_size", None) or cb_config.block_size


def cb_config_for(
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    page_size: int,
    max_batch_tokens: int,
    max_requests_per_batch: int,
    num_blocks: int | None,
) -> Any:
    """A ContinuousBatchingConfig with explicit sizes; on the CPU its memory-based
    auto-sizing has nothing to measure (it needs psutil), so everything is given."""
    from transformers import ContinuousBatchingConfig

    if num_blocks is None:
        # Room for every request at once, as the paged engine has: no preemption on either side.
        pages = [math.ceil((len(p) + n) / page_size) for p, n in zip(prompts, output_lens)]
        num_blocks = sum(pages)
    # transformers renamed block_size to page_size (5.2x); take whichever this version has.
    params = inspect.signature(ContinuousBatchingConfig).parameters
    size_arg = "page_size" if "page_size" in params else "block_size"
    return ContinuousBatchingConfig(
        **{size_arg: page_size},
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        allow_block_sharing=False,  # random prompts share no prefix; skip the hashing work
        seed=0,
    )


@torch.inference_mode()
def run_continuous_batching(
    model: Any,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    cb_config: Any,
    per_request_max_tokens: bool = True,
) -> SystemRun:
    """All requests through transformers' continuous batching manager.

    ``generate_batch`` takes one ``max_new_tokens`` for all requests; the manager it wraps
    takes one per request (``add_request(max_new_tokens=...)``). With per_request_max_tokens
    we drive the manager directly, as generate_batch does, so no request decodes past its own
    length, and time from submitting the requests to the last result: the manager's set-up
    (cache allocation, thread start/stop) is not timed, as the engine's constructor is not.
    Otherwise we time one generate_batch call (set-up included) with the maximum length and
    count only each request's own output_len tokens as output.
    """
    config = greedy_config(max(output_lens), pad_token_id=0)
    with quiet_cb_logs():
        if per_request_max_tokens:
            timer, drove = drive_manager(model, prompts, output_lens, config, cb_config)
            results = [r for r in drove if r is not None]
            note = "transformers continuous batching manager, per-request max_new_tokens"
        else:
            timer, results = _generate_batch(model, prompts, config, cb_config)
            note = "model.generate_batch, max_new_tokens = max(output_len), set-up timed"
    if len(results) != len(prompts):
        raise RuntimeError(f"continuous batching returned {len(results)} of {len(prompts)} results")
    outputs = [r[:n] for r, n in zip(results, output_lens)]
    settings = {
        "per_request_max_tokens": per_request_max_tokens,
        "attn_implementation": _attn_impl(model),
        "page_size": cb_page_size(cb_config),
        "num_blocks": cb_config.num_blocks,
        "max_batch_tokens": cb_config.max_batch_tokens,
        "max_requests_per_batch": cb_config.max_requests_per_batch,
        "allow_block_sharing": cb_config.allow_block_sharing,
    }
    notes = [note, "greedy, eos_token_id=-1 (disabled); no torch.compile or CUDA graphs on CPU"]
    generated = sum(len(r) for r in results)
    return SystemRun(timer.wall_s, timer.cpu_s, outputs, generated, notes, settings)


def _generate_batch(
    model: Any, prompts: Sequence[list[int]], generation_config: Any, cb_config: Any
) -> tuple[Timer, list[list[int]]]:
    """One timed ``model.generate_batch`` call; return (timer, outputs in input order)."""
    with Timer() as timer:
        raw = model.generate_batch(
            inputs=[list(p) for p in prompts],
            generation_config=generation_config,
            continuous_batching_config=cb_config,
        )
    return timer, [r.generated_tokens for r in raw.values()]  # generate_batch keeps input order


def drive_manager(
    model: Any,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    generation_config: Any,
    cb_config: Any,
    deadline: Deadline | None = None,
) -> tuple[Timer, list[list[int] | None]]:
    """generate_batch's loop with a per-request max_new_tokens, until every request finishes or
    the deadline passes; return (timer, outputs in input order, None for an unfinished one)."""
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max(output_lens),
        num_requests=len(prompts),
    )
    cm = model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=5,
        workload_hints=hints,
    )
    results: dict[str, list[int]] = {}
    with cm as manager, Timer() as timer:
        ids = [
            manager.add_request(list(p), request_id=f"req_{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, output_lens))
        ]
        deadline = deadline or Deadline.never()
        while len(results) < len(ids) and deadline.left() > 0:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                results[result.request_id] = list(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
    return timer, [results.get(i) for i in ids]
