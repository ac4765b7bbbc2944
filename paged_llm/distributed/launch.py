"""Starting, joining and tearing down a tensor-parallel world, and rank 0's per-step messages.

One node: rank 0 is the process that builds the engine. It spawns ranks 1..N-1 itself
(torch.multiprocessing, "spawn"), and all ranks meet on a TCPStore on a free loopback port.
Several nodes, or any hand-made launch: start every rank with torchrun; each process's engine
then joins the world from the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

Every rank builds the same engine in lockstep (so collectives meet in the same order). Rank 0
schedules and samples; for each step it broadcasts a :class:`StepMessage` (block moves and the
flat batch, small host-side data) and ranks > 0 run their shard of the same forward pass.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from paged_llm.distributed.checks import check_tensor_parallel, model_hf_config
from paged_llm.distributed.parallel_state import SPAWNED_ENV, TPGroup
from paged_llm.distributed.sharding import replicated_parameters

logger = logging.getLogger(__name__)

STOP = "stop"
LOOPBACK = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0
_UP_KEY = "paged_llm/up/{rank}"
_LIVE: weakref.WeakSet[TensorParallel] = weakref.WeakSet()  # worlds not yet shut down


@dataclass
class StepMessage:
    """What ranks > 0 need to run one step: block moves, then the flat batch (or None)."""

    block_ops: list[tuple[str, list[tuple[int, int]]]]
    batch: Any  # runner.batch.HostBatch


@dataclass
class CallMessage:
    """A call to run on every rank's model runner between steps (``LLM.collective_rpc``,
    ``load_weights``, sleep mode): a method name, or a picklable function taking the runner
    first; its arguments are pickled to ranks > 0 (tensors as CPU tensors)."""

    method: Any  # str | Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def run_call(runner: Any, method: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """Run one call on ``runner`` (a ModelRunner): ``runner.<method>(...)`` or
    ``method(runner, ...)``."""
    if isinstance(method, str):
        fn = None if method.startswith("_") else getattr(runner, method, None)
        if not callable(fn):
            raise ValueError(f"the model runner has no public method '{method}'")
        return fn(*args, **(kwargs or {}))
    if not callable(method):
        raise ValueError(f"method must be a name or a callable, got {type(method).__name__}")
    return method(runner, *args, **(kwargs or {}))


def _answer(runner: Any, msg: CallMessage) -> tuple[bool, Any]:
    """(True, result) or (False, error) of a call, in a form that can be pickled back."""
    try:
        answer: tuple[bool, Any] = (True, run_call(runner, msg.method, msg.args, msg.kwargs))
    except Exception as err:
        answer = (False, err)
    try:
        pickle.dumps(answer)
    except Exception as err:
        what = "result" if answer[0] else "error"
        answer = (False, RuntimeError(f"the call's {what} cannot be sent between ranks: {err}"))
    return answer


@dataclass
class _State:
    """What tear-down needs; kept apart from TensorParallel so a finalizer can hold it."""

    is_driver: bool
    processes: list[Any] = field(default_factory=list)  # ranks this process spawned
    owns_group: bool = True  # False when the user's code initialised torch.distributed
    object_group: Any = None  # gloo group for host objects (None: the default group is gloo)
    clean: bool = False  # rank 0 is between steps, so ranks > 0 are waiting for a message
    restore_threads: int | None = None  # rank 0's torch thread count before a CPU world


class TensorParallel:
    """This process's handle on the world: rank, device, messages, and tear-down."""

    def __init__(self, group: TPGroup, device: torch.device, state: _State) -> None:
        self.group = group
        self.device = device
        self._state = state
        # Runs on shutdown(), on garbage collection, or at interpreter exit, whichever is first.
        self._finalizer = weakref.finalize(self, _teardown, state)
        _LIVE.add(self)

    @property
    def is_driver(self) -> bool:
        """True on rank 0, which owns the scheduler."""
        return self.group.is_driver

    @property
    def processes(self) -> list[Any]:
        """The worker processes this rank spawned (empty on ranks > 0 and under torchrun)."""
        return list(self._state.processes)

    # ---- start-up, in lockstep on every rank ---------------------------------------------
    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV blocks that fit on every GPU)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._state.object_group)
        return int(t.item())

    @torch.no_grad()
    def sync_replicated(self, model: nn.Module) -> None:
        """Copy rank 0's replicated parameters to every rank (random-weight presets draw them
        per rank; loaded checkpoints already agree, and this costs one small broadcast each)."""
        import torch.distributed as dist

        for p in replicated_parameters(model):
            dist.broadcast(p.data, src=0)

    def finish_startup(self, runner: Any) -> None:
        """Rank 0: ready to step. Ranks > 0: serve rank 0's steps until it shuts down."""
        if self.is_driver:
            self._state.clean = True
            return
        self.serve(runner)
        self.shutdown()

    # ---- steps ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, block_ops: list, batch: Any) -> Iterator[None]:
        """Rank 0: send this step to ranks > 0, then run it locally inside the block."""
        self._state.clean = False  # stays False if the local step raises half-way
        self._send(StepMessage(block_ops, batch))
        yield
        self._state.clean = True

    def call(self, runner: Any, msg: CallMessage) -> list[Any]:
        """Rank 0, between steps: run a call on every rank; the results in rank order. An error
        on any rank is raised here (the first rank's first), after every rank has answered."""
        self._state.clean = False
        self._send(msg)
        answers = self._gather(_answer(runner, msg))
        self._state.clean = True
        for ok, value in answers:
            if not ok:
                raise value
        return [value for _, value in answers]

    def serve(self, runner: Any) -> None:
        """Ranks > 0: run each step (or call) rank 0 sends, until it sends STOP."""
        while True:
            msg = self._receive()
            if msg == STOP:
                return
            if isinstance(msg, CallMessage):
                self._gather(_answer(runner, msg))
                continue
            with torch.inference_mode():
                runner.run_batch(msg.block_ops, msg.batch)

    def _send(self, obj: Any) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([obj], src=0, group=self._state.object_group)

    def _gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, in rank order (None on ranks > 0)."""
        import torch.distributed as dist

        out = [None] * self.group.size if self.is_driver else None
        dist.gather_object(obj, out, dst=0, group=self._state.object_group)
        return out

    def _receive(self) -> Any:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._state.object_group)
        return box[0]

    def shutdown(self) -> None:
        """Stop the workers (rank 0) and leave the process group; safe to call twice."""
        self._finalizer()


def shutdown_all() -> None:
    """Shut down every tensor-parallel world of this process (e.g. after a failed test)."""
    for world in list(_LIVE):
        world.shutdown()


def _teardown(state: _State) -> None:
    """Stop ranks > 0 (a STOP message when they are waiting for one, else terminate them),
    wait for spawned processes, and destroy the process group if we created it."""
    import torch.distributed as dist

    alive = all(p.is_alive() for p in state.processes)
    if state.is_driver and state.clean and alive and dist.is_initialized():
        try:
            dist.broadcast_object_list([STOP], src=0, group=state.object_group)
        except Exception as err:  # a dead peer: fall through to terminate
            logger.warning("could not send STOP to tensor-parallel workers: %s", err)
    for p in state.processes:
        p.join(timeout=30 if state.clean else 0.1)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    state.clean = False
    if state.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    if state.restore_threads is not None:
        torch.set_num_threads(state.restore_threads)
        state.restore_threads = None


# ---- entry point the engine calls --------------------------------------------------------------
def start_tensor_parallel(config: Any) -> TensorParallel | None:
    """Join or create the tensor-parallel world for EngineConfig ``config``; None (and no
    torch.distributed at all) when tensor_parallel_size == 1."""
    n = config.model.tensor_parallel_size
    if n == 1 and not isinstance(n, bool):
        return None
    check_tensor_parallel(config, model_hf_config(config.model.model))
    use_cuda = config.model.device.startswith("cuda") or (
        config.model.device == "auto" and torch.cuda.is_available()
    )
    backend = "nccl" if use_cuda else "gloo"
    if SPAWNED_ENV in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        tp = _join(n, backend, use_cuda)
    else:
        tp = _launch(config, n, backend, use_cuda)
    tp.group = replace(tp.group, expert_parallel=config.model.enable_expert_parallel)
    return tp


def collective_timeout() -> datetime.timedelta:
    """How long a collective waits for a slow peer: torch's default 30 minutes, or
    $PAGED_LLM_TP_TIMEOUT_S (tests set less, so a hang fails instead of stalling)."""
    return datetime.timedelta(seconds=float(os.environ.get("PAGED_LLM_TP_TIMEOUT_S", 30 * 60)))


def cpu_threads_per_rank(world_size: int) -> int:
    """Intra-op threads for each of ``world_size`` CPU ranks on one machine."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _device(use_cuda: bool, local_rank: int) -> torch.device:
    if not use_cuda:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)  # NCCL uses the current device of each process
    return torch.device("cuda", local_rank)


def _launch(config: Any, n: int, backend: str, use_cuda: bool) -> TensorParallel:
    """Rank 0 on one node: spawn ranks 1..n-1 and meet them on a loopback TCPStore."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from paged_llm.distributed.worker import worker_main

    if dist.is_initialized():
        raise ValueError(
            "this process already has a torch.distributed process group (another tensor-"
            "parallel LLM?); call shutdown() on it first"
        )
    # port 0: the store binds a free port itself, so there is no race for it.
    store = dist.TCPStore(
        LOOPBACK, 0, n, is_master=True, timeout=collective_timeout(), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    state = _State(is_driver=True)
    for rank in range(1, n):
        p = ctx.Process(
            target=worker_main,
            args=(rank, n, store.port, config),
            name=f"paged-llm-tp-rank{rank}",
            daemon=True,  # never outlive this process
        )
        p.start()
        state.processes.append(p)
    if not use_cuda:
        # CPU ranks share the cores (each worker takes its share too, see worker.py): one full
        # OpenMP pool per rank oversubscribes them, and spinning threads then stall every op.
        state.restore_threads = torch.get_num_threads()
        torch.set_num_threads(cpu_threads_per_rank(n))
    try:
        _wait_for_workers(store, state.processes, n)
        device = _device(use_cuda, 0)
        dist.init_process_group(
            backend, store=store, rank=0, world_size=n, timeout=collective_timeout()
        )
        state.object_group = _object_group(backend)
    except BaseException:
        _teardown(state)
        raise
    logger.info("tensor parallel: rank 0 of %d (%s), workers %s", n, backend,
                [p.pid for p in state.processes])  # fmt: skip
    return TensorParallel(TPGroup(0, n), device, state)


def _wait_for_workers(store: Any, processes: list[Any], n: int) -> None:
    """Block until ranks 1..n-1 have checked in, failing fast if one of them dies."""
    keys = [_UP_KEY.format(rank=r) for r in range(1, n)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):  # non-blocking: a dead worker is noticed within 0.1 s
        time.sleep(0.1)
        dead = [p for p in processes if not p.is_alive()]
        if dead:
            raise RuntimeError(
                f"tensor-parallel worker {dead[0].name} exited with code {dead[0].exitcode} "
                "during start-up (its error is printed above)"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start in {STARTUP_TIMEOUT_S}s")


def _join(n: int, backend: str, use_cuda: bool) -> TensorParallel:
    """Ranks started by us (SPAWNED_ENV) or by torchrun: join from the environment."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != n:
        raise ValueError(f"WORLD_SIZE={world} but tensor_parallel_size={n}")
    device = _device(use_cuda, int(os.environ.get("LOCAL_RANK", rank)))
    state = _State(is_driver=rank == 0, owns_group=not dist.is_initialized())
    if os.environ.get(SPAWNED_ENV) == "1":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n,
            is_master=False, timeout=collective_timeout(),
        )  # fmt: skip
        store.set(_UP_KEY.format(rank=rank), "1")
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=n, timeout=collective_timeout()
        )
    elif state.owns_group:
        dist.init_process_group(backend, rank=rank, world_size=n, timeout=collective_timeout())
    state.object_group = _object_group(dist.get_backend())
    return TensorParallel(TPGroup(rank, n), device, state)


def _object_group(backend: str) -> Any:
    """A gloo group for host-side objects when tensors go over NCCL (None: reuse gloo)."""
    import torch.distributed as dist

    return None if backend == "gloo" else dist.new_group(backend="gloo")
