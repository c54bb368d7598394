# memlab developer tasks. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help setup run smoke test test-fast lint sweep report bench

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

setup:  ## create .venv and install memlab (CPU torch when there is no GPU)
	@bash scripts/setup.sh

run: setup  ## train the embedded default (tiny model, generated data, CPU) and print its memory
	OMP_NUM_THREADS=2 $(PY) -m memlab

smoke: setup  ## a 4-step run
	$(PY) -m memlab debug=smoke

test: setup  ## the whole test suite (what CI runs): two workers, a test file stays on one
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: setup  ## unit tests only
	$(PY) -m pytest -q tests/unit

lint: setup  ## ruff
	$(PY) -m ruff check src tests benchmarks scripts

sweep: setup  ## the ready foundation sweep (peft x attention); any other: memlab -m sweep=<name>
	$(PY) -m memlab -m sweep=foundation

bench: setup  ## benchmarks (print tables, write benchmarks/results/*.json)
	$(PY) benchmarks/packing.py
