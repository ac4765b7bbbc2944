"""The native CPU paged decode kernel (``cpu_decode.cpp``): built on first use with the
machine's C++ compiler through ``torch.utils.cpp_extension`` and cached per CPU.

The build needs g++ (or $CXX) and ninja; it takes about a minute once, then loads in
milliseconds. ``-march=native`` lets the compiler use the CPU's vector units, so the build
directory is keyed by the CPU's feature flags as well as the source and torch version.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

from paged_llm.recipes.cache import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine()


def _build_name() -> str:
    """Extension name: one build per (source, flags, torch version, CPU features)."""
    key = "|".join([_SOURCE.read_text(), " ".join(_CFLAGS), torch.__version__, _cpu_flags()])
    return "paged_llm_cpu_decode_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; a venv that is not activated has the pip-installed
    one only in its own bin directory (the ``ninja`` package knows where)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> None:
    """Compile (once per machine) and load the kernel, registering
    ``torch.ops.paged_llm.paged_decode_cpu``; raises RuntimeError if it cannot be built."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    name = _build_name()
    build_dir = cache_root() / "extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("building the native CPU attention kernel into %s (once)", build_dir)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # compiler or ninja missing, or a build error
        raise RuntimeError(
            f"could not build the native CPU attention kernel ({_SOURCE.name}): {e}. "
            "It needs a C++ compiler (g++) and ninja; or use attention_backend='torch'."
        ) from e


@functools.cache
def is_available() -> bool:
    """Whether the kernel builds and loads on this machine (tries once per process)."""
    try:
        load()
    except RuntimeError as e:
        logger.warning("%s", e)
        return False
    return True


def paged_decode_cpu(
    out: torch.Tensor,  # [B, Hq, D]: written in place
    query: torch.Tensor,  # [B, Hq, D]: one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]: query's dtype, int8 or fp8
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [>= B, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= B] int32: context length including the query token
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] float32: quantized
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,  # attend to the last W positions only
) -> None:
    """One-token attention of each sequence over its paged context, written into ``out``
    (a quantized cache is dequantized on the fly: code * scale of its token and head)."""
    load()
    torch.ops.paged_llm.paged_decode_cpu(
        out, query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
        sliding_window or 0,
    )  # fmt: skip
