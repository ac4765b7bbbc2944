"""The reading path of one step (docs/architecture.md, "The reading path of one step"): the
package files that run during LLMEngine.step(), measured under a profiler, are the ones the page
lists, and their count and size stay within the page's bound."""

import re
from pathlib import Path

from experiments.reading_path import files_run_by, step_files

DOC = Path(__file__).parents[1] / "docs" / "architecture.md"
# Today's size (2026-12-07: 20 files, 3,443 lines), a ratchet: the target is 20 files
# and 3,500 lines. Lower these as the step gets shorter; raising them needs a reason.
MAX_FILES = 20
MAX_LINES = 3_463


def documented_files() -> set[str]:
    """The files the page's reading-path table lists."""
    text = DOC.read_text()
    section = text.split("## The reading path of one step", 1)[1].split("\n## ", 1)[0]
    return {"paged_llm/" + m for m in re.findall(r"^\| `([^`]+\.py)` \|", section, re.M)}


def test_a_step_runs_the_documented_files_within_the_bound():
    files = step_files()
    assert set(files) == documented_files(), "update docs/architecture.md's reading path"
    assert len(files) <= MAX_FILES
    assert sum(files.values()) <= MAX_LINES


def test_the_profiler_sees_only_code_that_ran(tmp_path):
    """Functions called (also from a thread the call starts) are seen; imported ones are not."""
    import threading

    from paged_llm.core import request  # imported here, never called below
    from paged_llm.core.kv import block_pool

    def work():
        from paged_llm.utils.checks import is_int

        t = threading.Thread(target=is_int, args=(3,))
        t.start()
        t.join()

    seen = {p.name for p in files_run_by(work)}
    assert "checks.py" in seen
    assert {Path(block_pool.__file__).name, Path(request.__file__).name}.isdisjoint(seen)
