"""A branch-and-bound Hydra sweeper for maximizing a job's return value over a grid: the jobs
are ordered by an upper bound of their objective (best first) and launched a few at a time
through the configured launcher (basic, joblib, submitit), each told the best value returned
so far, so that a job which cannot beat it can stop early (experiments.capacity_plan prunes
such a deployment by a bound or by one failing probe). The best job is the grid's best when
every job's pruning is sound; the rows of pruned jobs hold bounds, not numbers.

    python -m experiments.capacity_plan -m hydra/sweeper=capacity_bnb hydra/launcher=parallel
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import get_method
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class BranchAndBoundSweeper(BasicSweeper):
    """The grid of ``params`` (as the basic sweeper expands it), ordered by ``bound`` (the
    import path of a function: a job's composed config -> an upper bound of its return
    value), launched ``batch_size`` jobs at a time with the override ``incumbent=<best so
    far>`` (absent for the first batch). Once no job left can beat the best by its bound,
    the rest go in one batch (each still writes its own result, a pruned one)."""

    def __init__(
        self, bound: str, incumbent: str, batch_size: int = 2,
        params: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(max_batch_size=None, params=params)  # batches: batch_size, below
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.bound, self.incumbent, self.batch_size = bound, incumbent, batch_size

    def jobs(self, arguments: list[str]) -> list[list[str]]:
        """Every job's overrides (the grid of ``params`` and the command line's sweeps)."""
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        return self.split_arguments(overrides, None)[0]

    def bounds(self, jobs: Sequence[list[str]]) -> list[float]:
        """Each job's bound, from its composed config."""
        assert self.hydra_context is not None and self.config is not None
        fn = get_method(self.bound)
        loader = self.hydra_context.config_loader
        return [float(fn(loader.load_sweep_config(self.config, list(j)))) for j in jobs]

    def sweep(self, arguments: list[str]) -> Any:
        """Launch the jobs best bound first, passing the best return value on."""
        assert self.config is not None and self.launcher is not None
        jobs = self.jobs(arguments)
        bounds = self.bounds(jobs)
        order = sorted(range(len(jobs)), key=lambda i: -bounds[i])
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        best, done, returns = -math.inf, 0, []
        while done < len(order):
            left = order[done:]
            hopeless = best > -math.inf and all(bounds[i] <= best for i in left)
            take = left if hopeless else left[: self.batch_size]
            told = [] if best == -math.inf else [f"{self.incumbent}={best!r}"]
            batch = [[*jobs[i], *told] for i in take]  # composed once already, by bounds()
            results = self.launcher.launch(batch, initial_job_idx=done)
            values = [float(r.return_value) for r in results]
            best = max([best, *values])
            log.info(f"jobs {done}..{done + len(take) - 1}: best so far {best:.6g}")
            done += len(take)
            returns.append(results)
        return returns
