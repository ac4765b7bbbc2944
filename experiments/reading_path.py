"""The reading path of one engine step: which of the package's files run during
``LLMEngine.step()`` of a small greedy generate, and how many lines they hold.

A reader who follows one step must read these files; tests/test_reading_path.py keeps their
count and size within the bound docs/architecture.md states. Usage:
``python -m experiments.reading_path [checkpoint=tiny] [attention_backend=torch]``
(configs/reading_path.yaml; writes reading_path.json into the Hydra run directory).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from experiments.common.cli import hydra_app
from paged_llm.metrics.run_info import run_info, write_json

PACKAGE = Path(__file__).resolve().parents[1] / "paged_llm"


def files_run_by(fn: Callable[[], object]) -> set[Path]:
    """The package's source files with a Python function called while ``fn()`` runs (in any
    thread it starts)."""
    seen: set[str] = set()

    def profile(frame, event, arg):  # a call of a Python function: note its file
        if event == "call":
            seen.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    files = {Path(f).resolve() for f in seen if f.endswith(".py")}
    return {f for f in files if f.is_relative_to(PACKAGE)}


def line_count(path: Path) -> int:
    """Lines in a file, as ``wc -l`` counts them."""
    return len(path.read_text().splitlines())


def step_files(model: str = "tiny", attention_backend: str = "torch") -> dict[str, int]:
    """{file relative to the repository: lines} of every package file that runs during the
    steps of a small greedy generate (prefill and decode) on the default engine."""
    from paged_llm import LLM, SamplingParams

    llm = LLM(model, attention_backend=attention_backend, cpu_kv_cache_gib=0.01, seed=0)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(([5, 9, 17, 33], [7, 3, 11])):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    engine.step()  # warm-up: lazy imports and first-call set-up are not the step's code

    def steps() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    files = files_run_by(steps)
    root = PACKAGE.parent
    return {str(f.relative_to(root)): line_count(f) for f in sorted(files)}


def write(cfg: Mapping[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Print the step's files with their lines and the totals; write reading_path.json."""
    files = step_files(cfg["checkpoint"], cfg["attention_backend"])
    for name, lines in files.items():
        print(f"{lines:6d}  {name}")
    total = sum(files.values())
    print(f"{total:6d}  lines in {len(files)} files")
    doc = {**run_info("real"), "files": files, "lines": total, "count": len(files)}
    print(f"wrote {write_json(out_dir, 'reading_path.json', doc)}")
    return doc


def main() -> None:
    """``python -m experiments.reading_path [key=value ...]`` (configs/reading_path.yaml)."""
    hydra_app("reading_path", write)


if __name__ == "__main__":
    main()
