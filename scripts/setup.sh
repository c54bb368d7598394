#!/usr/bin/env bash
# Create .venv and install memlab (editable) with its dev extras. Idempotent and quick when
# nothing changed. On a machine without an NVIDIA GPU the CPU build of torch is installed
# first, so pip never pulls the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MEMLAB_VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
STAMP="$VENV/.memlab-setup"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] GPU found: installing torch==$TORCH_VERSION (CUDA build)"
    $PIP install "torch==$TORCH_VERSION"
  else
    echo "[setup] no GPU: installing the CPU build of torch==$TORCH_VERSION"
    # one try, no retries: where that index is unreachable (a closed network with a local
    # mirror that serves the CPU wheel) pip would otherwise back off on every dependency
    $PIP install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
      --timeout 20 --retries 0 || $PIP install "torch==$TORCH_VERSION"
  fi
fi
echo "[setup] installing memlab (editable) with the dev extras"
$PIP install -e ".[dev]"
touch "$STAMP"
