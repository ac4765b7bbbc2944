"""A directory cache whose entries are built once, atomically, even by concurrent processes."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Root of the cache: $PAGED_LLM_CACHE, default ~/.cache/paged_llm."""
    return Path(os.environ.get("PAGED_LLM_CACHE") or "~/.cache/paged_llm").expanduser()


def cached_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Return ``final``, first calling ``build(tmp_dir)`` and renaming it into place if absent.

    The entry appears only complete (rename is atomic), so an interrupted build leaves nothing
    behind. An exclusive lock per entry makes a second process that wants the same entry wait
    for the first instead of training the same model twice.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        if final.is_dir():  # built by the process we waited for
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            build(tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # already gone after a successful rename
    return final
