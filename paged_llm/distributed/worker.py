"""Entry point of the worker processes (ranks 1..N-1) that rank 0 spawns on one node."""

from __future__ import annotations

import os
from typing import Any

from paged_llm.distributed.parallel_state import SPAWNED_ENV


def worker_main(rank: int, world_size: int, master_port: int, config: Any) -> None:
    """Build rank 0's model and runner (joining its world), serve its steps, then exit."""
    # The same variables torchrun sets, so the engine joins exactly as a torchrun rank would.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
    )
    os.environ[SPAWNED_ENV] = "1"
    import torch

    from paged_llm.distributed.launch import cpu_threads_per_rank
    from paged_llm.engine.worker import load_worker

    if not torch.cuda.is_available() or config.model.device == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))  # the cores are shared

    worker = load_worker(config)  # the model and runner only: rank 0 schedules
    worker.allocate()
    worker.parallel.finish_startup(worker.runner)  # returns after rank 0 sends STOP
