"""Chatbot prompts from single-turn length pairs (the paper's Fig. 17), and multi-turn
conversations whose turns arrive as separate requests (plain Python).

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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation, served as its own request."""

    conversation: int
    index: int  # 0 = the first turn
    history: tuple[int, ...]  # lengths of the earlier messages and replies, alternating
    message_len: int
    reply_len: int
    arrival_time: float

    @property
    def prompt_len(self) -> int:
        """The whole conversation so far plus this turn's message."""
        return sum(self.history) + self.message_len


def conversation_turns(
    pairs: list[LengthPair],
    start_times: list[float],
    seed: int,
    turns: int,
    think_time_s: float,
    max_total_len: int,
) -> list[Turn]:
    """Conversations starting at ``start_times``, each up to ``turns`` turns; every turn is an
    (input, output) pair of ``pairs`` (message, reply). The next turn arrives an exponential
    think time (mean ``think_time_s``) after the previous one arrived, open loop: the earlier
    reply may not be finished yet, as with impatient users or a trace replayed at a fixed
    rate. A conversation ends before a turn whose prompt plus reply would reach
    ``max_total_len``. Sorted by arrival time."""
    if not pairs:
        raise ValueError("cannot build conversations from an empty list of length pairs")
    rng = random.Random(seed)
    out = []
    for c, start in enumerate(start_times):
        history: tuple[int, ...] = ()
        t = start
        for i in range(turns):
            pair = rng.choice(pairs)
            if sum(history) + pair.input_len + pair.output_len >= max_total_len:
                break
            out.append(Turn(c, i, history, pair.input_len, pair.output_len, t))
            history += (pair.input_len, pair.output_len)
            t += rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
    return sorted(out, key=lambda turn: (turn.arrival_time, turn.conversation, turn.index))
