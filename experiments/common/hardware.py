"""What ran a benchmark, for its JSON: the host and its threads, or the accelerator."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from paged_llm.metrics.run_info import cpu_name


def host_info(device: str) -> dict[str, Any]:
    """The CPU, the threads torch may use, the device name and the library versions."""
    import transformers

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpus_available": affinity,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "cuda_device": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def device_info(device: torch.device) -> dict[str, Any]:
    """The device type and, on CUDA, its name, memory, capability and SM count."""
    info: dict[str, Any] = {
        "type": device.type,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            name=p.name,
            total_memory_GiB=p.total_memory / 2**30,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
        )
    return info


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
