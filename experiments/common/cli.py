"""The experiments' command-line style: a Hydra app over ``configs/<name>.yaml`` whose job
writes its results into the run directory. Hydra is imported only when the app runs, so a
module that uses this still imports where Hydra is absent."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Absolute, so Hydra finds the YAML whether an entry point runs as ``-m`` (a file) or is imported
# and called (a module, where a relative path would be looked up as a Python package).
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def hydra_app(config_name: str, write: Callable[[Any, Path], Any]) -> None:
    """Run ``write(cfg, run_dir)`` as the Hydra app of ``configs/<config_name>.yaml``, with the
    command line's overrides (``python -m experiments.X key=value ...``, ``--help``)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    def job(cfg: Any) -> None:
        """One Hydra job: the experiment, writing into this job's run directory."""
        write(cfg, Path(HydraConfig.get().runtime.output_dir))

    job.__wrapped__ = write  # type: ignore[attr-defined]  # Hydra names the job after write's file
    hydra.main(config_path=CONFIG_DIR, config_name=config_name, version_base="1.3")(job)()


def settings(cfg: Any) -> SimpleNamespace:
    """The config's keys as attributes (``s.num_blocks``), plain Python values."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return SimpleNamespace(**{k: v for k, v in plain.items() if k != "hydra"})


def command(module: str) -> str:
    """The command that reproduces this run: the module and the Hydra overrides it was given
    (none when ``write`` is called outside a Hydra app, as tests do)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return shlex.join(["python", "-m", module, *overrides])
