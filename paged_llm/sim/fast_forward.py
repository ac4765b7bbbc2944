"""An exact fast-forward of pure-decode windows in the simulator (plain Python, no torch).

While nothing waits or is swapped and every running request decodes one plain token per step,
a step changes little: each request's context grows by one, a request crosses into a new
block every ``block_size`` steps, and a request leaves when it reaches its length. So the
``SimulatedExecutor`` can advance such a window without the scheduler: each step's
``StepShape`` (integers) is kept up to date by counting, priced by the same
``step_time`` and added to the clock in the same order, and only the events run for real,
in the scheduler's order: a block allocation through the KV manager's ``allocate_slots``
(the same block ids), a finish through ``Scheduler.finish_request`` (the same frees). The
requests' tokens and times are written once, when they finish or the window ends. Records,
end time and block accounting come out identical to stepping one by one
(tests/test_sim_fast_forward.py).

A window ends before a step the ordinary loop must take: an arrival is due, ``stop_time`` is
reached, the memory sampler or the sharing statistics would look at the step, the pool lacks
the step's blocks (a preemption), or nothing runs. It is not entered when anything else
could happen in a step: a waiting, swapped or prefilling request, draft slots, a beam search
or samples still to fork, a stop other than by length, a sliding window, or a KV policy that
cannot promise plain growth (``KVCacheManager.decode_block_steps``: copy-on-write of shared
blocks, prefix-cache registration).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_llm.core.request import Request, RequestStatus
from paged_llm.metrics.serving import IterationRecord
from paged_llm.sim.cost_model import StepShape

SAMPLED_TOKEN = 0  # the simulator's placeholder output token (SimulatedForward's)


@dataclass
class _Seq:
    """One running request in a window: where it started and how many steps it has left."""

    request: Request
    computed: int  # num_computed_tokens at the window's start
    left: int  # steps until it reaches its length and finishes
    blocks: Any  # iterator over the steps at which it takes a new block


def stops_by_length_only(req: Request) -> bool:
    """True when the request can only stop by length (no grammar, no stop strings, no stop on
    the simulator's token, not pooling): fixed for its life."""
    p = req.sampling_params
    return (
        req.guide is None
        and req.stop_strings is None
        and not req.is_pooling
        and (p.ignore_eos or req.eos_token_id != SAMPLED_TOKEN)
        and SAMPLED_TOKEN not in p.stop_token_ids
    )


def decodes_one(req: Request) -> bool:
    """True when the request's next step computes one token, with no drafts."""
    return (
        req.status is RequestStatus.RUNNING
        and len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_computed_tokens == 1
        and not req.final_token_pending
        and not req.spec_token_ids
    )


class DecodeFastForward:
    """Advances the simulator's pure-decode windows exactly; counts what it skipped."""

    def __init__(
        self, scheduler: Any, sim: Any, owner: dict[str, Any], block_size: int,
        iterations: list[IterationRecord], retire: Callable[[list[Request], float], None],
    ) -> None:  # fmt: skip
        self.scheduler, self.kv, self.sim, self.owner = scheduler, scheduler.kv, sim, owner
        self.block_size, self.iterations, self.retire = block_size, iterations, retire
        self.num_iterations = 0  # steps advanced here instead of through the scheduler
        self.num_windows = 0
        self.num_waiting_iterations = 0  # of which some request waited (for a seat or room)
        self._plain: set[str] = set()  # sequences that stop by length only, in plain groups

    def _window(self) -> list[_Seq] | None:
        """The running requests as a window, or None when a step could do anything more.
        Requests may wait, for a seat, the token budget or KV room (``_admits`` says when
        they may start), if the head is a plain one: no group, no adapter, no static batch."""
        s = self.scheduler
        if s.swapped or not s.running or len(s.requests) != len(s.running) + len(s.waiting):
            return None
        if s.waiting:
            head = s.waiting[0]
            if self.kv.static_batching or head.group_id is not None or head.lora_int_id:
                return None
        limits = s.limits
        if limits.num_lookahead_slots or len(s.running) > limits.max_num_batched_tokens:
            return None
        seqs, plain = [], self._plain
        for req in s.running:
            if not decodes_one(req):
                return None
            if req.request_id not in plain:
                g = self.owner[req.request_id]  # samples once forked stay forked
                if g.is_beam or g.unforked or not stops_by_length_only(req):
                    return None
                plain.add(req.request_id)
            left = req.max_output_tokens - len(req.output_token_ids)
            steps = self.kv.decode_block_steps(req, left)
            if steps is None:
                return None
            seqs.append(_Seq(req, req.num_computed_tokens, left, iter(steps)))
        return seqs

    def advance(self, must_step: Callable[[float], bool]) -> int:
        """Advance while the window lasts; ``must_step(clock)``: the ordinary loop must take
        the step starting at ``clock``. Returns the steps advanced (0: none)."""
        if must_step(self.sim.clock):
            return 0
        seqs = self._window()
        if seqs is None:
            return 0
        bs, kv, sim, step_time = self.block_size, self.kv, self.sim, self.sim.step_time
        alloc_at: dict[int, list[tuple[int, _Seq]]] = {}  # step -> (running index, request)
        finish_at: dict[int, list[tuple[int, _Seq]]] = {}
        phase = [0] * bs  # running requests by context % block_size: who enters a block when
        context = blocks = 0  # the sums before step 1
        for i, q in enumerate(seqs):
            _push(alloc_at, next(q.blocks, None), i, q)
            finish_at.setdefault(q.left, []).append((i, q))
            phase[q.computed % bs] += 1
            context += q.computed
            blocks += -(-q.computed // bs)
        n = len(seqs)
        times: list[float] = []  # the clock after each step: the tokens' times
        usage = kv.usage()
        waiting = len(self.scheduler.waiting)
        changed = True  # the pool or the batch changed: may the head of the queue start now?
        step = 0
        while n and not must_step(sim.clock):
            due = alloc_at.pop(step + 1, None)
            if due:
                if len(due) > kv.num_free_blocks():
                    break  # the scheduler would preempt: the ordinary loop's step
                for i, q in sorted(due, key=_index):  # in running order: the same block ids
                    q.request.num_computed_tokens = q.computed + step
                    if not kv.allocate_slots(q.request, 1):
                        raise RuntimeError("decode_block_steps promised a block it cannot give")
                    _push(alloc_at, next(q.blocks, None), i, q)
                usage = kv.usage()
                changed = True
            if waiting and changed:
                if self._admits(n):
                    # the ordinary step admits it; it makes this step's allocations again,
                    # which finds them made and changes nothing
                    break
                changed = False
            step += 1
            blocks += phase[(1 - step) % bs]  # requests whose context enters a new block
            kv_read = context + n * step
            dt = step_time(StepShape(n, n, kv_read, blocks, kv_read, 0))
            start, sim.clock = sim.clock, sim.clock + dt
            times.append(sim.clock)
            self.iterations.append(IterationRecord(start, dt, n, n, waiting, 0, usage, 0, None))
            done = finish_at.pop(step, None)
            if done:
                finished = []
                for _, q in sorted(done, key=_index):
                    _write(q, step, times)
                    self.scheduler.finish_request(
                        q.request.request_id, RequestStatus.FINISHED_LENGTH, sim.clock
                    )
                    finished.append(q.request)
                    n -= 1
                    context -= q.computed
                    blocks -= -(-(q.computed + step) // bs)
                    phase[q.computed % bs] -= 1
                usage = kv.usage()
                changed = True
                self.retire(finished, sim.clock)
        if not step:
            return 0
        for q in seqs:
            if q.left > step:
                _write(q, step, times)
        last = self.iterations[-1]
        sim.start, sim.dt, sim.beam_groups = last.time, last.duration, {}
        self.num_iterations += step
        self.num_waiting_iterations += step if waiting else 0
        self.num_windows += 1
        return step

    def _admits(self, running: int) -> bool:
        """False only when the scheduler surely starts no waiting request in a step with
        ``running`` decodes (Scheduler._schedule_waiting): the head finds no seat, no token
        budget (Scheduler.num_new_tokens) or no room by the KV policy's admission rule.
        Such a refusal changes nothing, so the window goes on."""
        s = self.scheduler
        head, limits = s.waiting[0], s.limits
        if running + 1 > limits.max_num_seqs:
            return False
        tokens = s.num_new_tokens(head, limits.max_num_batched_tokens - running)  # 0: no budget
        return tokens > 0 and self.kv.can_admit(head, tokens)

    def to_dict(self) -> dict[str, int]:
        """The counters, for the run's trace."""
        return {"iterations": self.num_iterations, "windows": self.num_windows,
                "waiting_iterations": self.num_waiting_iterations}  # fmt: skip


def _index(item: tuple[int, _Seq]) -> int:
    return item[0]


def _push(at: dict[int, list[tuple[int, _Seq]]], step: int | None, i: int, q: _Seq) -> None:
    """Schedule request ``q``'s next block at ``step`` (None: no more; past its end: never)."""
    if step is not None and step <= q.left:
        at.setdefault(step, []).append((i, q))


def _write(q: _Seq, steps: int, times: list[float]) -> None:
    """What ``steps`` decode steps did to the request: tokens, their times, the counter."""
    req = q.request
    req.num_computed_tokens = q.computed + steps
    req.output_token_ids.extend([SAMPLED_TOKEN] * steps)
    req.token_times.extend(times[:steps])
    if req.first_token_time is None:
        req.first_token_time = times[0]
