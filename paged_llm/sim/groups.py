"""User requests served by several sequences in simulated runs (parallel samples, beam search),
forked the way the engine forks them, and the block sharing read off the real KV manager
(plain Python, no torch).

* Parallel sampling (``n > 1``) follows the engine's ``OutputProcessor`` (its ``add`` and
  ``before_forward``): with a sharing policy the first sample prefills the prompt and, in the
  step where that prefill completes, the other samples fork its block table (shared, not
  copied) and re-run the last prompt token, so each draws its own first token. With a
  reservation policy the n samples are independent requests of one group (the paper's Orca
  baselines).
* Beam search (``beam_width > 1``) follows ``paged_llm/beam_search.py``: once every live beam has
  its next-token distribution, ``beam_width`` extensions are forked off their parents (blocks
  shared, copied on write) and the parents are aborted; a block frees when no beam references
  it. There are no logits here, so which parent each new beam extends is a modelling choice
  (``WorkloadSpec.beam_parents``): by default each is drawn uniformly at random among the live
  beams (seeded), a neutral model of how beams descend from one another; "best" (all from one
  beam) and "own" (beam i extends beam i) bound the sharing from above and below; "measured"
  replays how real beam search with a trained model picked parents (by rank, from
  ``data/beam_parent_ranks.json``, recorded by experiments/beam_sharing.py). A
  reservation policy cannot share, so there the beams run as ``beam_width`` independent
  sequences that each reserve their own space (the copies a contiguous cache would need at each
  fork are not charged).
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from paged_llm.core.request import Request, RequestStatus
from paged_llm.core.scheduler import Scheduler
from paged_llm.metrics.serving import RequestRecord
from paged_llm.sampling_params import SamplingParams
from paged_llm.workloads.arrivals import TimedRequest, Workload

PARENT_RANKS_FILE = Path(__file__).parent / "data" / "beam_parent_ranks.json"


@functools.cache
def _parent_rank_tables() -> dict[str, list[list[int]]]:
    return json.loads(PARENT_RANKS_FILE.read_text())["parent_ranks"]


def measured_parent_ranks(width: int) -> list[list[int]]:
    """[child rank][parent rank] counts of real beam search at ``width`` (see the data file's
    provenance); a clear error for a width that was not measured."""
    tables = _parent_rank_tables()
    if str(width) not in tables:
        raise ValueError(
            f"no measured beam-parent ranks for width {width} (have {sorted(tables)}); "
            "record them with python -m experiments.beam_sharing, or use beam_parents=uniform"
        )
    return tables[str(width)]


# A conversation's messages are made of one id of its own, from this one up, so its later turns
# find its earlier turns' blocks (whose replies the simulator fills with 0) and no other's.
CONVERSATION_IDS = 1 << 20


def prompt_ids(tr: TimedRequest, index: int, distinct: bool) -> list[int]:
    """Prompt token ids. Zeros (the artifact's) unless ``distinct``: then the shared prefix is
    one fixed pattern and the rest of the prompt is unique to the request, so prefix caching
    finds exactly the shared prefix (all-zero prompts would all hash alike)."""
    if tr.conversation >= 0:  # the history as it was sent: messages, and replies of filler 0
        own = CONVERSATION_IDS + tr.conversation
        ids = [t for k, n in enumerate(tr.history) for t in [0 if k % 2 else own] * n]
        return ids + [own] * (tr.input_len - len(ids))
    if not distinct:
        return [0] * tr.input_len
    own = 2 + index  # ids 0 and 1 are the output filler and the prefix
    return [1] * tr.prefix_len + [own] * (tr.input_len - tr.prefix_len)


class SequenceGroup:
    """One request of the workload and the sequences that serve it."""

    def __init__(
        self,
        tr: TimedRequest,
        prompt: list[int],
        max_model_len: int,
        sharing: bool,
        rng: random.Random,
        parents: str = "uniform",
    ) -> None:
        self.tr = tr
        self.parents = parents  # see workloads.arrivals.BEAM_PARENTS
        self.width = tr.beam_width if tr.beam_width > 1 else tr.n
        self.is_beam = tr.beam_width > 1 and sharing  # forked each step; else independent
        self.rng = rng
        self.max_model_len = max_model_len
        self.params = SamplingParams(temperature=0.0, max_tokens=tr.output_len, ignore_eos=True)
        self.group_id = tr.request_id if self.width > 1 else None
        self._ids = itertools.count(1)
        first = self._request(tr.request_id, prompt)
        others = [self._request(f"{tr.request_id}#{i}", prompt) for i in range(1, self.width)]
        self.live: list[Request] = [first]  # sequences in the scheduler
        self.unforked: list[Request] = []  # samples waiting to fork off the first one's prefill
        if self.is_beam:
            pass  # one sequence prefills; the beams fork off it
        elif sharing:
            self.unforked = others
        else:
            self.live += others
        self.done: list[Request] = []  # finished sequences (parallel sampling)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.token_times: list[float] = []
        self.preemptions_before = 0  # of beam generations already aborted

    def _request(self, request_id: str, prompt: list[int], **kw: object) -> Request:
        return Request(
            request_id, prompt, self.params, arrival_time=self.tr.arrival_time,
            priority=self.tr.priority, max_model_len=self.max_model_len, group_id=self.group_id,
            **kw,
        )  # fmt: skip

    @property
    def finished(self) -> bool:
        """True once every sequence of the request has finished."""
        return self.finished_time is not None

    def start(self, scheduler: Scheduler) -> None:
        """Queue the sequences that start now."""
        for req in self.live:
            scheduler.add_request(req)

    def fork_samples(self, scheduler: Scheduler) -> list[Request]:
        """Fork the waiting samples off the first one, whose prefill completes in this step
        (called between schedule and update, as the engine does); return the new sequences."""
        first = self.live[0]
        forked, self.unforked = self.unforked, []
        for child in forked:
            scheduler.fork_sample(first, child)
        self.live += forked
        return forked

    def on_finished(self, req: Request, now: float) -> None:
        """A sequence finished by length (parallel samples and plain requests)."""
        self.live.remove(req)
        self.done.append(req)
        if not self.live and not self.unforked:
            self.finished_time = now

    def beams_ready(self) -> bool:
        """Every live beam has computed all its tokens: the next step can be chosen."""
        return self.is_beam and bool(self.live) and all(
            r.status is RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens
            for r in self.live
        )  # fmt: skip

    def advance_beams(self, scheduler: Scheduler, now: float) -> list[Request]:
        """One beam-search step: record the token, then finish or fork the next beams off
        uniformly drawn parents and abort the parents. Returns the new beams."""
        beams = self.live
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
            self.first_scheduled_time = beams[0].first_scheduled_time
        self.preemptions_before += max(b.num_preemptions for b in beams)
        children: list[Request] = []
        if len(beams[0].output_token_ids) + 1 >= self.tr.output_len:
            self.finished_time = now
        else:
            for i in range(self.width):
                parent = self._parent(beams, i)
                child = self._request(
                    f"{self.tr.request_id}~{next(self._ids)}", parent.prompt_token_ids,
                    output_token_ids=parent.output_token_ids + [0],
                    num_computed_tokens=parent.num_computed_tokens,
                )  # fmt: skip
                scheduler.fork_request(parent, child)
                children.append(child)
        for b in beams:
            scheduler.abort_request(b.request_id)
        self.live = children
        return children

    def _parent(self, beams: list[Request], i: int) -> Request:
        if len(beams) == 1 or self.parents == "best":
            return beams[0]
        if self.parents == "own":
            return beams[i]
        if self.parents == "measured":  # live beams are kept best first: an index is a rank
            weights = measured_parent_ranks(len(beams))[i]
            return beams[self.rng.choices(range(len(beams)), weights=weights)[0]]
        return self.rng.choice(beams)

    def fill_record(self, rec: RequestRecord) -> None:
        """Copy what the request's sequences did into its record (unfinished: no end time)."""
        seqs = self.done + self.live
        if self.is_beam:
            rec.first_scheduled_time = self.first_scheduled_time or _first(
                r.first_scheduled_time for r in seqs
            )
            rec.first_token_time = self.first_token_time
            rec.token_times = list(self.token_times)
            live = max((r.num_preemptions for r in self.live), default=0)
            rec.num_preemptions = self.preemptions_before + live
        else:
            rec.first_scheduled_time = _first(r.first_scheduled_time for r in seqs)
            rec.first_token_time = _first(r.first_token_time for r in seqs)
            rec.token_times = seqs[0].token_times  # the first sample's, as a representative
            rec.num_preemptions = max(r.num_preemptions for r in seqs)
        rec.finished_time = self.finished_time


def _first(times: object) -> float | None:
    vals = [t for t in times if t is not None]  # type: ignore[attr-defined]
    return min(vals) if vals else None


@dataclass
class SharingStats:
    """Blocks held by the running sequences with sharing (each shared block once) and without
    (each sequence's whole block table), accumulated over iterations weighted by their
    duration: the paper's Fig. 15 saving is 1 - with / without."""

    block_seconds_shared: float = 0.0
    block_seconds_unshared: float = 0.0
    iteration_savings: list[float] = field(default_factory=list)

    def add(self, tables: list[list[int]], dt: float) -> None:
        """One iteration: the running sequences' block tables and the step's duration."""
        unshared = sum(len(t) for t in tables)
        if not unshared:
            return
        shared = len({b for t in tables for b in t})
        self.block_seconds_shared += shared * dt
        self.block_seconds_unshared += unshared * dt
        self.iteration_savings.append(1.0 - shared / unshared)

    def to_dict(self) -> dict[str, float | int | None]:
        """Time-weighted saving, the plain per-iteration mean, and the totals."""
        u = self.block_seconds_unshared
        its = self.iteration_savings
        return {
            "saving": 1.0 - self.block_seconds_shared / u if u else None,
            "mean_iteration_saving": sum(its) / len(its) if its else None,
            "iterations": len(its),
            "block_seconds_shared": self.block_seconds_shared,
            "block_seconds_unshared": u,
        }


def check_groups_fit(workload: Workload, scheduler: Scheduler, max_model_len: int) -> None:
    """Refuse, before the run, a workload with a group (n samples or beams) that could never
    run together under this policy, as the engine refuses such a request when it is added;
    the simulation would otherwise preempt it forever."""
    seen = set()
    for tr in workload.requests:
        key = (tr.input_len, tr.output_len, tr.n, tr.beam_width)
        if key in seen or (tr.n == 1 and tr.beam_width == 1):
            continue
        seen.add(key)
        # sharing=False: every member is built at once (the sequences a recomputation restarts)
        g = SequenceGroup(tr, [0] * tr.input_len, max_model_len, False, random.Random(0))
        scheduler.check_group_fits(g.live, "beam_width" if tr.beam_width > 1 else "n")
