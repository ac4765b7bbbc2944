"""``--help`` of every Hydra entry point (configs/hydra/help/entry.yaml): the running module's
docstring and the leading comment of its primary config (what it does, examples), then the
config groups, where results land and every key. The ``entry_help`` resolver gives the first
part; registered by hydra_plugins/paged_llm_configs when Hydra starts, like the schemas."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def config_comment(config_name: str) -> str:
    """The leading ``#`` comment block of ``configs/<config_name>.yaml``, uncommented."""
    path = CONFIG_DIR / f"{config_name}.yaml"
    lines = path.read_text().splitlines() if path.is_file() else []
    head = []
    for line in lines:
        if not line.startswith("#"):
            break
        head.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(head)


def entry_help() -> str:
    """What the running entry point does: its module docstring, then its config's comment."""
    from hydra.core.hydra_config import HydraConfig

    doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    comment = config_comment(str(HydraConfig.get().job.config_name))
    return "\n\n".join(part for part in (doc, comment) if part)


def register() -> None:
    """Register the ``entry_help`` resolver (once)."""
    if not OmegaConf.has_resolver("entry_help"):
        OmegaConf.register_new_resolver("entry_help", entry_help)


register()
