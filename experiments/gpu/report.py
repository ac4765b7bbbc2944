"""The check's JSON document and the time-boxed run of one section into it."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from experiments.common.timing import Budget, Deadline

SCHEMA = "paged_llm.gpu_check/1"


@dataclass
class Report:
    """The JSON document, rewritten after every section."""

    path: Path
    doc: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        """Write atomically (a run killed mid-write keeps the previous version)."""
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=json_default))
        os.replace(tmp, self.path)


def json_default(obj: Any) -> Any:
    """JSON for what the sections record beyond plain types: dtypes and paths."""
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def run_section(
    report: Report,
    name: str,
    budget: Budget,
    cap_s: float,
    min_s: float,
    fn: Callable[[Deadline], dict[str, Any]],
) -> dict[str, Any]:
    """Run one section within min(cap_s, budget left); record its result, skip or error."""
    left = budget.left()
    start = time.perf_counter()
    if left < min_s:
        result = {"status": "skipped", "reason": f"budget: {left:.0f} s left, needs >= {min_s} s"}
    else:
        try:
            result = {"status": "ok", **fn(Deadline.after(min(cap_s, left)))}
        except Exception as err:  # recorded, and the next section still runs
            result = {
                "status": "error",
                "reason": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=8),
            }
    result["seconds"] = round(time.perf_counter() - start, 2)
    # a thread a section leaves running (transformers' continuous-batching loop past its join
    # timeout, say) takes the GIL from later sections' launch-bound loops: say so
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        result["threads_left_running"] = others
    report.doc["sections"][name] = result
    report.write()
    print(f"[gpu_check] {name}: {result['status']} in {result['seconds']} s", flush=True)
    return result
