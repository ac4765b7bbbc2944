"""A lower bound on the simulated time a deployment needs to serve a workload's requests, from
the same roofline that prices the simulator's steps (plain Python, no torch).

However the scheduler batches them, the requests' steps together must compute every token
once (prompt, then one decode step per further output token), read each token's context once
per step it is in, and hold each context's blocks for every step it decodes. Each step also
pays the fixed overhead and streams the weights once, so the fewest steps that fit the
seats (``max_num_seqs``), the token budget and the KV pool give the least of those fixed
costs. The roofline's step time is a per-step ``max(memory, compute)``, and a sum of maxima
is at least the maximum of the sums, so pricing the whole work as one step of summed shape
(plus the fixed costs of the fewest steps) is a lower bound on the busy time of any schedule
without preemption or sharing (``RooflineCostModel.least_busy_time``; a fitted linear step law
has its own, ``LinearCostModel.least_busy_time``). A recomputation only adds work. The
capacity search uses it to skip deployments that cannot beat the best found so far: when
even this bound exceeds the arrival span, requests arrive faster than they can be served.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from paged_llm.sim.cost_model import StepShape


def ceil_sum(lo: int, hi: int, size: int) -> int:
    """sum(ceil(c / size) for c in range(lo, hi + 1)), in closed form (0 when hi < lo)."""

    def upto(x: int) -> int:  # sum of ceil(c / size) for c in 1..x
        q, r = divmod(max(x, 0), size)
        return size * q * (q + 1) // 2 + r * (q + 1)

    return upto(hi) - upto(lo - 1) if hi >= lo else 0


def work_of(requests: Iterable[Any], block_size: int) -> dict[str, int]:
    """What serving these requests (``input_len``, ``output_len``) computes at the least:
    the summed ``StepShape`` fields of their prompt and decode steps, the seat-steps (each
    request is in one step per output token) and the block-steps (blocks held per step)."""
    new = kv = blocks = pairs = seats = 0
    for r in requests:
        i, o = r.input_len, r.output_len
        d = o - 1  # decode steps after the prompt's step made the first token
        new += i + d
        kv += i + d * i + d * (d + 1) // 2  # the prompt's own tokens, then i + k at step k
        blocks += ceil_sum(i + 1, i + d, block_size) + -(-i // block_size)
        pairs += i * (i + 1) // 2 + d * i + d * (d + 1) // 2
        seats += o
    return {"new": new, "kv": kv, "blocks": blocks, "pairs": pairs, "seats": seats}


def busy_time_lower_bound(cost: Any, settings: Any, num_blocks: int, requests: Any) -> float:
    """Seconds of steps any schedule of ``requests`` takes at the least on ``cost``'s
    deployment (a ``RooflineCostModel``) with ``settings``' limits and ``num_blocks`` KV
    blocks (see the module's docstring)."""
    w = work_of(requests, settings.block_size)
    if w["new"] == 0:
        return 0.0
    steps = max(
        math.ceil(w["seats"] / settings.max_num_seqs),
        math.ceil(w["new"] / settings.max_num_batched_tokens),
        math.ceil(w["blocks"] / num_blocks),
    )
    total = StepShape(w["seats"], w["new"], w["kv"], w["blocks"], w["pairs"])
    return cost.least_busy_time(total, steps)
