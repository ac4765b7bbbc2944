"""Beam search in the style of vLLM's ``llm.beam_search(prompts, BeamSearchParams(...))``.

Each beam is a sequence in the scheduler. After every step the driver ranks all extensions of
a prompt's live beams, forks the winners' block tables (shared by reference, copied on write)
and drops the losers, whose blocks free the moment no beam references them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_llm.core.request import Request, RequestStatus
from paged_llm.engine.core import LogprobsForward
from paged_llm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_llm.engine.llm_engine import LLMEngine


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # only 0 (deterministic beam search) is supported
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.temperature != 0.0:
            raise ValueError("beam search is deterministic: temperature must be 0")


@dataclass
class BeamSearchSequence:
    """One finished beam: all tokens and their text (prompt included, as in vLLM), per-step
    logprobs, total logprob."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float
    text: str | None = None
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class Beam:
    """A live beam: its engine request (the KV it owns) and its tokens' logprobs so far."""

    request: Request
    logprobs: list[float]
    cum_logprob: float


def score_beam(seq: BeamSearchSequence, num_prompt: int, length_penalty: float) -> float:
    """Cumulative logprob over generated length ** length_penalty (transformers' convention)."""
    return seq.cum_logprob / max(1, len(seq.tokens) - num_prompt) ** length_penalty


def check_beam_engine(engine: LLMEngine) -> None:
    """ValueError for an engine beam search cannot run on: one whose policy cannot share blocks,
    or one that speculates (its scheduler gives every decode draft slots, which beam steps
    never fill; such a search once never finished)."""
    kv = engine.scheduler.kv
    if not kv.supports_sharing:
        raise ValueError(f"beam search needs a block-sharing policy, not '{kv.name}'")
    if engine.drafter is not None:
        raise ValueError(
            "beam search does not use speculative decoding; build the LLM "
            "without speculative_config for it"
        )


def beam_search(
    engine: LLMEngine,
    prompts: list[Any],
    params: BeamSearchParams,
    on_step: Callable[[LLMEngine], None] | None = None,
    on_fork: Callable[[int, int, int], None] | None = None,
    lora_requests: list[Any] | None = None,  # one LoRARequest (or None) per prompt
) -> list[BeamSearchOutput]:
    """Run beam search for every prompt in one batch; return the beams of each, best first.

    ``on_step(engine)`` runs after every engine step (e.g. to read the KV manager's sharing);
    ``on_fork(num_parents, child_rank, parent_rank)`` for every new beam (ranks: 0 = best)."""
    check_beam_engine(engine)
    sched = engine.scheduler
    width = params.beam_width
    ids = itertools.count()
    base = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
    live: list[list[Beam]] = []
    done: list[list[BeamSearchSequence]] = []
    num_prompt: list[int] = []
    firsts = []
    for i, prompt in enumerate(prompts):  # every prompt is checked before any is added
        lora = lora_requests[i] if lora_requests else None
        group = engine.inputs.make_request(f"beam-{i}", prompt, base, lora_request=lora)
        req = group.members[0].request
        sched.check_group_fits([req] * width, "beam_width")
        firsts.append(req)
    for i, req in enumerate(firsts):
        req.group_id = f"beam-{i}"  # a prompt's beams are preempted together
        sched.add_request(req)
        live.append([Beam(req, [], 0.0)])
        done.append([])
        num_prompt.append(req.num_prompt_tokens)
    rows: dict[str, Any] = {}
    forward = LogprobsForward(engine.runner, rows)  # beam search picks the tokens itself
    while any(live):
        engine.core.step(forward)
        if on_step is not None:
            on_step(engine)
        for p, beams in enumerate(live):
            if beams and all(beam_ready(b, rows) for b in beams):
                live[p] = advance_beams(
                    engine, beams, rows, done[p], params, width, ids, p, on_fork
                )
    results = []
    for p, seqs in enumerate(done):
        seqs.sort(key=lambda s: score_beam(s, num_prompt[p], params.length_penalty), reverse=True)
        if engine.tokenizer is not None:  # vLLM's LLM.beam_search: the prompt's text included
            for s in seqs:
                s.text = engine.tokenizer.decode(s.tokens)
        results.append(BeamSearchOutput(seqs[:width]))
    return results


@dataclass
class BeamStep:
    """One step's outcome for a prompt's beams: ``(parent index, token, logprob, cumulative
    logprob)`` of each extension kept (best first) and of each that ended with EOS."""

    kept: list[tuple[int, int, float, float]]
    ended: list[tuple[int, int, float, float]]


def rank_extensions(
    cum_logprobs: list[float],  # per live beam
    tops: list[list[tuple[float, int]]],  # per live beam: its top 2 * width (logprob, token)
    width: int,
    eos: int | None,
    ignore_eos: bool,
) -> BeamStep:
    """The best ``width`` extensions of the beams (transformers' rule: an EOS extension ends a
    hypothesis, and counts only if it ranks among the best ``width``)."""
    candidates = [
        (cum + lp, lp, tok, i)
        for i, (cum, top) in enumerate(zip(cum_logprobs, tops))
        for lp, tok in top
    ]
    best = heapq.nlargest(2 * width, candidates, key=lambda c: c[0])
    step = BeamStep([], [])
    for rank, (cum, lp, tok, i) in enumerate(best):
        if len(step.kept) == width:
            break
        if not ignore_eos and tok == eos:
            if rank < width:
                step.ended.append((i, tok, lp, cum))
            continue
        step.kept.append((i, tok, lp, cum))
    return step


def beam_ready(beam: Beam, rows: dict[str, Any]) -> bool:
    """A beam can be extended once its next-token logprobs exist and its KV is all computed."""
    r = beam.request
    return (
        r.request_id in rows
        and r.status is RequestStatus.RUNNING
        and r.num_computed_tokens == r.num_tokens
    )


def advance_beams(
    engine: LLMEngine,
    beams: list[Beam],
    rows: dict[str, Any],
    done: list[BeamSearchSequence],
    params: BeamSearchParams,
    width: int,
    ids: Any,
    p: int,
    on_fork: Callable[[int, int, int], None] | None = None,
) -> list[Beam]:
    """Keep the best ``width`` extensions of a prompt's beams; fork them, drop the parents."""
    sched = engine.scheduler
    eos = engine.eos_token_id
    tops = []
    for b in beams:
        row = rows.pop(b.request.request_id)
        top = row.topk(min(2 * width, row.shape[0]))
        tops.append(list(zip(top.values.tolist(), top.indices.tolist())))
    final = len(beams[0].logprobs) + 1 >= params.max_tokens  # all of a prompt's beams align
    step = rank_extensions([b.cum_logprob for b in beams], tops, width, eos, params.ignore_eos)
    for i, tok, lp, cum in step.ended:
        parent = beams[i]
        tokens = parent.request.all_token_ids + [tok]
        done.append(BeamSearchSequence(tokens, parent.logprobs + [lp], cum, None, "stop"))
    new_beams: list[Beam] = []
    for i, tok, lp, cum in step.kept:
        parent = beams[i]
        if final:
            tokens = parent.request.all_token_ids + [tok]
            done.append(BeamSearchSequence(tokens, parent.logprobs + [lp], cum))
            continue
        child = Request(
            request_id=f"beam-{p}-{next(ids)}",
            prompt_token_ids=parent.request.prompt_token_ids,
            sampling_params=parent.request.sampling_params,
            arrival_time=parent.request.arrival_time,
            eos_token_id=eos,
            max_model_len=engine.max_model_len,
            output_token_ids=parent.request.output_token_ids + [tok],
            num_computed_tokens=parent.request.num_computed_tokens,
            group_id=parent.request.group_id,
            lora_int_id=parent.request.lora_int_id,
        )
        sched.fork_request(parent.request, child)
        if on_fork is not None:  # live beams are kept best first, so an index is a rank
            on_fork(len(beams), len(new_beams), i)
        new_beams.append(Beam(child, parent.logprobs + [lp], cum))
    for b in beams:
        sched.abort_request(b.request.request_id)
    return new_beams
