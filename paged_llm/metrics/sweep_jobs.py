"""Every job of a multirun, composed before the first one starts, so that a bad override in
any job (an unknown group option, a combination the experiment refuses) stops the whole sweep
before any work rather than after the jobs ahead of it."""

from __future__ import annotations

import itertools

from omegaconf import DictConfig

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def job_overrides(config: DictConfig) -> list[list[str]]:
    """The override list of each job the basic sweeper launches (the cartesian product of the
    command line's sweeps, in its order); empty for other sweepers, which choose as they go."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return []
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in parsed
    ]
    return [list(job) for job in itertools.product(*choices)]


def compose_job(config: DictConfig, overrides: list[str]) -> DictConfig:
    """One job's full config, composed as the sweeper will (raises as the job would)."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().hydra.config_loader.load_sweep_config(config, overrides)
