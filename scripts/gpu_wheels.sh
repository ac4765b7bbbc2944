#!/usr/bin/env bash
# Wheels of the pure-Python packages the Hydra apps need that the lent GPU machine lacks
# (hydra-core, omegaconf, antlr4-python3-runtime; docs/gpu.md), built from the versions in
# .venv into .whl/, which a device run carries and installs with --no-index --target.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
.venv/bin/python -m pip wheel -q --no-deps -w .whl \
  "hydra-core==$(version hydra-core)" "omegaconf==$(version omegaconf)" \
  "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
ls .whl
