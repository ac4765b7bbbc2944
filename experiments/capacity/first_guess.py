"""Where a deployment's rate search starts: an analytic estimate of the highest request rate
it can serve at all, from the cost model and the workload's mean lengths (plain Python). The
search only uses it as a first probe; its answer comes from simulated runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paged_llm.sim.cost_model import StepShape


def mean_lengths(requests: Sequence[Any]) -> tuple[float, float, float]:
    """A workload's mean prompt and output lengths, and the mean context of a decoding
    request over time (tokens): a request decodes for as many steps as its output, so its
    context counts in proportion to it, and the long requests weigh most."""
    if not requests:
        raise ValueError("a workload without requests has no mean lengths")
    n = len(requests)
    out = sum(r.output_len for r in requests)
    held = sum(r.output_len * (r.input_len + r.output_len / 2) for r in requests)
    return sum(r.input_len for r in requests) / n, out / n, held / out


def analytic_throughput(
    cost: Any, settings: Any, num_blocks: int, mean_input: float, mean_output: float,
    context: float,
) -> float:  # fmt: skip
    """Requests per second the deployment serves when busy: as many requests decode together
    as ``max_num_seqs`` and the KV pool allow (each holding the mean ``context`` of a decoding
    request), each decode step priced by ``cost.step_time`` at that context, plus each
    prompt's prefill alone. An estimate (reservation policies hold more per request, prefills
    share steps with decodes), not a bound the search relies on."""
    in_pool = num_blocks * settings.block_size / context
    batch = max(1, int(min(settings.max_num_seqs, in_pool)))
    step = cost.step_time(StepShape.decode(batch, round(context), settings.block_size))
    n = max(1, round(mean_input))
    blocks = -(-n // settings.block_size)
    prefill = cost.step_time(StepShape(1, n, n, blocks, n * (n + 1) // 2))
    return 1.0 / (mean_output * step / batch + prefill)
