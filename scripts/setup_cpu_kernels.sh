#!/usr/bin/env bash
# The GPU half of memlab on a CPU (issue 28): Liger-Kernel's Triton kernels in Triton's
# interpreter and bitsandbytes' 4-/8-bit layers, for the `cpu_kernels` tests (tests/cpu_kernels).
#
# A small environment beside the main one: the three packages alone, installed with .venv's
# pip into a target dir that goes on PYTHONPATH in front of .venv (torch, transformers, memlab
# come from .venv). Not in the dev extras because, installed in .venv, they would slow every
# test: peft imports bitsandbytes whenever it is installed (+~1 s for each of the suite's
# hundreds of processes, measured 1.9 -> 2.7 s and 2.6 -> 3.9 s for `import peft` on 2 loaded
# cores) and logs a warning at each import on CPUs with AVX512-BF16, and triton (1 GB; a 286 MB
# wheel) is imported by torch itself when present.
#
#   bash scripts/setup_cpu_kernels.sh             # -> .cpu-kernels (MEMLAB_CPU_KERNELS to move it)
#   TRITON_INTERPRET=1 PYTHONPATH=.cpu-kernels .venv/bin/python -m pytest -q -m cpu_kernels tests/cpu_kernels
#
# Idempotent; returns at once when done and this script did not change since. On a CUDA machine
# use the main environment instead: pip install 'memlab[gpu]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
DIR=${MEMLAB_CPU_KERNELS:-.cpu-kernels}
STAMP="$DIR/.memlab-cpu-kernels-setup"
PACKAGES=(triton==3.9.0 liger-kernel==0.8.5 bitsandbytes==0.50.2)

if [ -f "$STAMP" ] && [ "$STAMP" -nt scripts/setup_cpu_kernels.sh ]; then
  exit 0
fi
start=$(date +%s)
rm -rf "$DIR"
"$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$DIR" "${PACKAGES[@]}"
PYTHONPATH=$DIR "$PY" - <<'PYEOF'
import importlib.metadata as md

print("[setup_cpu_kernels]", " | ".join(
    f"{name} {md.version(name)}" for name in ("triton", "liger-kernel", "bitsandbytes")))
PYEOF
touch "$STAMP"
echo "[setup_cpu_kernels] done in $(( $(date +%s) - start )) s: $DIR ($(du -sh "$DIR" | cut -f1))"
