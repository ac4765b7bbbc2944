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

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(ARGS)

test-quick: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow" $(ARGS)
