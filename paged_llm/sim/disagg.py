"""Disaggregated prefill in the simulator (DistServe, Splitwise): prefill instances and decode
instances, each the real scheduler and KV manager on its own simulated GPU, a request's prompt
KV crossing a link from one to the other; beside colocated replicas on as many GPUs.

A prefill instance runs each prompt with one output token. When it finishes, its prompt's KV
takes ``bytes / link bandwidth + latency`` to reach a decode instance, whose KV manager finds
the prompt's blocks through a connector (``TransferredPrompts``: the same lookup a consumer
engine does through ``kv_transfer_config``) and computes only the prompt's last partial block
before decoding. Instances advance in time order, each on its own clock. Plain Python.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_llm.core.request import Request
from paged_llm.core.scheduler import Scheduler
from paged_llm.engine.core import EngineCore, StepState
from paged_llm.kv_transfer.shared_storage import chain_keys
from paged_llm.sampling_params import SamplingParams
from paged_llm.sim.executor import quiet_preemption_warnings, step_shape
from paged_llm.sim.groups import prompt_ids
from paged_llm.sim.settings import ServingSettings, build_scheduler
from paged_llm.workloads.arrivals import Workload

LAYOUTS = ("colocated", "disaggregated")


class TransferredPrompts:
    """A decode instance's connector: the block keys of prompts whose KV has arrived."""

    can_save, can_load = False, True

    def __init__(self) -> None:
        self.keys: set[int] = set()

    def block_keys(self, known, tokens, block_size, num_blocks, salt=""):
        """As every connector: SHA-256 chained over the blocks' token ids."""
        return chain_keys(known, tokens, block_size, num_blocks, salt)

    def contains(self, key: int) -> bool:
        """True once the block's KV has arrived."""
        return key in self.keys

    def arrive(self, tokens: Sequence[int], block_size: int) -> None:
        """Every full block of this prompt is now here."""
        self.keys.update(chain_keys([], tokens, block_size, len(tokens) // block_size))


@dataclass(eq=False)  # instances are compared by identity
class _Instance:
    """One simulated GPU: a scheduler, its own clock, requests due to arrive."""

    scheduler: Scheduler
    step_time: Any  # StepShape -> seconds
    block_size: int
    connector: TransferredPrompts | None = None
    clock: float = 0.0
    busy_s: float = 0.0
    inbox: list[tuple[float, int, Request]] = field(default_factory=list)  # a heap by time
    core: EngineCore = field(init=False)  # the engine's step, with the model's time simulated

    def __post_init__(self) -> None:
        self.core = EngineCore(self.scheduler, self._simulated_forward, [], lambda: self.clock)

    def next_time(self) -> float:
        """When this instance next has something to do (inf: nothing)."""
        if self.scheduler.has_unfinished():
            return self.clock
        return max(self.clock, self.inbox[0][0]) if self.inbox else math.inf

    def advance(self) -> list[Request]:
        """Admit what arrived, run one step (or jump to the next arrival); the finished."""
        self.clock = self.next_time()
        while self.inbox and self.inbox[0][0] <= self.clock:
            self.scheduler.add_request(heapq.heappop(self.inbox)[2])
        if not self.scheduler.has_unfinished():
            return []
        return self.core.step().finished

    def _simulated_forward(self, step: StepState) -> None:
        """Advance this instance's clock by the step's simulated time; a token per sample."""
        out = step.out
        if not out.scheduled:
            raise RuntimeError("a simulated instance can run none of its requests")
        dt = self.step_time(step_shape(out, self.block_size))
        self.clock += dt
        self.busy_s += dt
        step.sampled = {s.request.request_id: [0] for s in out.scheduled if s.samples}


@dataclass
class DisaggRun:
    """Per-request latencies of one simulated run, and each instance's busy share."""

    layout: str
    num_gpus: int
    request_ids: list[str]  # in the order of the latency lists
    ttft_s: list[float]
    tpot_s: list[float]
    e2el_s: list[float]
    busy: dict[str, float]  # per instance: the share of the run it was stepping
    transfer_s: list[float]
    loaded_blocks: int  # prompt blocks decode instances found transferred instead of computing
    preemptions: int

    def slo_attainment(self, ttft_slo: float, tpot_slo: float) -> float:
        """The share of requests that met both targets."""
        met = sum(a <= ttft_slo and b <= tpot_slo for a, b in zip(self.ttft_s, self.tpot_s))
        return met / max(1, len(self.ttft_s))


def simulate(
    workload: Workload,
    executor: Any,  # sim.executor.SimulatedExecutor: hardware, model shape, cost model
    settings: ServingSettings,
    layout: str = "disaggregated",
    num_prefill: int = 1,
    num_decode: int = 1,
    link_gb_per_s: float = 25.0,
    link_latency_s: float = 1e-3,
    decode_settings: ServingSettings | None = None,
) -> DisaggRun:
    """Serve ``workload`` on ``num_prefill + num_decode`` simulated GPUs: disaggregated, or
    (``layout="colocated"``) as that many independent replicas; requests are dealt round-robin."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout '{layout}'; choose one of {list(LAYOUTS)}")
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("need at least one prefill and one decode instance")
    if any(r.n > 1 or r.beam_width > 1 or r.conversation >= 0 for r in workload.requests):
        raise ValueError("the disaggregation simulator serves single-sequence requests only")
    bs = settings.block_size
    cm = executor.cost_model(bs)

    def instance(s: ServingSettings, connector: TransferredPrompts | None = None) -> _Instance:
        extra = {"kv_connector": connector} if connector is not None else {}
        sched = build_scheduler("paged", s, executor.num_blocks(s, cm), **extra)
        return _Instance(sched, cm.step_time, bs, connector)

    gpus = num_prefill + num_decode
    if layout == "colocated":
        front = [instance(settings) for _ in range(gpus)]
        back: list[_Instance] = []
    else:
        front = [instance(settings) for _ in range(num_prefill)]
        back = [instance(decode_settings or settings, TransferredPrompts())
                for _ in range(num_decode)]  # fmt: skip
    order = itertools.count()
    arrival, prompts, handoff_at = {}, {}, {}
    deal = itertools.cycle(front)

    def request(rid: str, out_len: int) -> Request:
        """The request ``rid`` (its prompt, its arrival) asking for ``out_len`` tokens."""
        params = SamplingParams(max_tokens=out_len, ignore_eos=True)
        return Request(rid, prompts[rid], params, max_model_len=settings.max_model_len,
                       arrival_time=arrival[rid][0])  # fmt: skip

    for i, tr in enumerate(sorted(workload.requests, key=lambda r: r.arrival_time)):
        prompts[tr.request_id] = prompt_ids(tr, i, distinct=True)
        arrival[tr.request_id] = (tr.arrival_time, tr.output_len)
        req = request(tr.request_id, tr.output_len if layout == "colocated" else 1)
        heapq.heappush(next(deal).inbox, (tr.arrival_time, next(order), req))
    decoders = itertools.cycle(back)
    kv_bytes = executor.model.kv_bytes_per_token
    done: dict[str, Request] = {}
    instances = front + back
    while True:
        inst = min(instances, key=_Instance.next_time)
        if inst.next_time() == math.inf:
            break
        with quiet_preemption_warnings():  # an overloaded rate preempts thousands of times
            finished = inst.advance()
        for req in finished:
            if inst in back or layout == "colocated":
                done[req.request_id] = req
                continue
            # the prompt's KV travels to a decode instance, which then runs the request
            rid, tokens = req.request_id, prompts[req.request_id]
            at = inst.clock + len(tokens) * kv_bytes / (link_gb_per_s * 1e9) + link_latency_s
            handoff_at[rid] = (inst.clock, at)
            dec = next(decoders)
            dec.connector.arrive(tokens, bs)
            heapq.heappush(dec.inbox, (at, next(order), request(rid, arrival[rid][1])))
    ttft, tpot, e2el = [], [], []
    ids = sorted(done, key=lambda rid: arrival[rid][0])
    for rid in ids:
        req = done[rid]
        t0, out_len = arrival[rid]
        ttft.append(req.first_token_time - t0)
        e2el.append(req.finished_time - t0)
        if out_len > 1:
            tpot.append((req.finished_time - req.first_token_time) / (out_len - 1))
        else:
            tpot.append(0.0)
    end = max((i.clock for i in instances), default=0.0)
    if layout == "colocated":
        names = [f"replica{k}" for k in range(len(front))]
    else:
        names = [f"prefill{k}" for k in range(len(front))] + [
            f"decode{k}" for k in range(len(back))
        ]
    busy = {n: i.busy_s / end if end else 0.0 for n, i in zip(names, instances)}
    transfer = [at - t for t, at in handoff_at.values()]
    loaded = sum(i.scheduler.kv.prefix_hits for i in back)
    preemptions = sum(i.scheduler.num_preemptions_total for i in instances)
    return DisaggRun(layout, gpus, ids, ttft, tpot, e2el, busy, transfer, loaded, preemptions)
