# Two entry points (see README): `make run` and `make test`; both set up .venv first.
PY := .venv/bin/python
.PHONY: setup run test test-quick lint format

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m paged_llm.main $(ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# Two pytest workers, one thread each: on 2 cores this took the suite from 11m56s to 7m03s
# (every test passing both ways), since much of it is Python, subprocess and interpreter time
# that one process cannot overlap. WORKERS=0 runs in one process (e.g. to debug a test).
WORKERS ?= 2
TEST := OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(WORKERS)

test: lint
	$(TEST) $(ARGS)

# The quick tiers (tests/tiers.py): bookkeeping, kernels and in-process engines, not slow.
test-quick: lint
	$(TEST) -m "(unit or engine) and not slow" $(ARGS)
