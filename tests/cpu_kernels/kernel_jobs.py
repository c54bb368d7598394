"""Shared pieces of the ``cpu_kernels`` tests (Liger in Triton's interpreter, bitsandbytes on
CPU): their skip marks, and a fresh process that runs several jobs in order.

Why a fresh process: Liger's model patch replaces module-level functions and classes of
transformers (``apply_rotary_pos_emb``, ``LlamaRMSNorm``) for the rest of the process, so a
plain job after a Liger job in one process would run Liger's RoPE; and Triton reads
``TRITON_INTERPRET`` once, when torch imports it. The jobs of one call run in the order given
(the plain ones first); each records whether Liger was already imported when it started.

    python tests/cpu_kernels/kernel_jobs.py OUT_DIR NAME=OVERRIDES_JSON ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlab import _guards

HERE = Path(__file__).resolve().parent
HOW = ("`make test` runs them in a small environment beside .venv (scripts/setup_cpu_kernels.sh "
       "builds .cpu-kernels; TRITON_INTERPRET=1 PYTHONPATH=.cpu-kernels .venv/bin/python -m "
       "pytest -m cpu_kernels tests/cpu_kernels)")
NEEDS_BNB = pytest.mark.skipif(not _guards.has("bitsandbytes"),
                               reason=f"bitsandbytes is not installed here; {HOW}")
NEEDS_LIGER = pytest.mark.skipif(
    not (_guards.has("liger_kernel") and os.environ.get("TRITON_INTERPRET") == "1"),
    reason=f"needs liger-kernel and triton with TRITON_INTERPRET=1 set at start; {HOW}")


def run_in_fresh_process(tmp_path: Path, jobs: dict[str, list[str]],
                         timeout: float = 600) -> dict[str, dict]:
    """Run ``jobs`` (name -> overrides, in order) in one new process; their summaries by
    name."""
    args = [f"{name}={json.dumps(overrides)}" for name, overrides in jobs.items()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, str(Path(__file__)), str(tmp_path), *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in jobs}


def main(argv: list[str]) -> None:
    from memlab_testing import run_job

    out = Path(argv[0])
    for arg in argv[1:]:
        name, _, overrides = arg.partition("=")
        liger_before = "liger_kernel" in sys.modules
        summary = run_job(out, json.loads(overrides), name=name)
        summary["liger_imported_before"] = liger_before
        (out / f"{name}.json").write_text(json.dumps(summary, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
