"""Chatbot prompts from single-turn length pairs (the paper's Fig. 17; plain Python).

The published ShareGPT trace holds only the first turn of each conversation. A chatbot request
is a later turn: its prompt is the whole history (every earlier user message and reply) plus
the new user message. We build such requests by concatenating turns drawn from the trace: the
number of earlier turns is geometric with a given mean (an assumption: the trace does not say
how long conversations are), each turn an (input, output) pair of the trace. The caller cuts
prompts to their last ``max_prompt_len`` tokens (the paper: 1024) and outputs to
``max_output_len`` (1024); see ``WorkloadSpec.chat_turns``.
"""

from __future__ import annotations

import math
import random

from paged_llm.workloads.lengths import LengthPair


def conversation_pairs(
    pairs: list[LengthPair], n: int, seed: int, mean_earlier_turns: float
) -> list[LengthPair]:
    """n (prompt, output) pairs of chatbot turns: prompt = sum of the earlier turns' input and
    output lengths + this turn's input; output = this turn's output. Uncut."""
    if not pairs:
        raise ValueError("cannot build conversations from an empty list of length pairs")
    if mean_earlier_turns < 0:
        raise ValueError(f"mean_earlier_turns must be >= 0, got {mean_earlier_turns}")
    rng = random.Random(seed)
    p = 1.0 / (1.0 + mean_earlier_turns)  # geometric on {0, 1, ...} with this mean
    out = []
    for _ in range(n):
        k = 0 if p >= 1 else int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
        history = sum(sum(rng.choice(pairs)) for _ in range(k))
        turn = rng.choice(pairs)
        out.append(LengthPair(history + turn.input_len, turn.output_len))
    return out
