#!/usr/bin/env bash
# Create .venv and install paged-llm with its dev tools. Idempotent: re-runs only when
# pyproject.toml changes. Takes a CPU build of torch on machines without an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.installed-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
[ -f "$STAMP" ] && exit 0
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! $VENV/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP install "torch>=2.4"                       # CUDA build from PyPI
  else
    # CPU build: a local wheel (pip's find-links) or PyTorch's CPU index, never multi-GB CUDA wheels.
    $PIP install "torch==2.13.0+cpu" 2>/dev/null \
      || $PIP install "torch" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
$PIP install -e ".[dev]"
rm -f $VENV/.installed-*
touch "$STAMP"
