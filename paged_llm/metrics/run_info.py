"""What every result file records: hardware, real or simulated, date, command."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or the platform string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info(device: str = "cpu") -> dict[str, Any]:
    """Hardware the run used."""
    import torch

    info: dict[str, Any] = {
        "device": device,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_info(mode: str, device: str = "cpu", hardware: str | None = None) -> dict[str, Any]:
    """Provenance block for a result: mode ('real' or 'simulated'), hardware, date, command."""
    return {
        "mode": mode,
        "hardware": hardware or hardware_info(device),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def write_json(out_dir: str | Path, filename: str, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as ``out_dir/filename`` (creating the directory); return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    path.write_text(json.dumps(doc, indent=2))
    return path
