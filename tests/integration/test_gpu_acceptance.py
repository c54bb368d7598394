"""benchmarks/gpu_acceptance.py, the one command that certifies memlab's GPU paths, cannot rot
before a GPU comes: on this CPU its dry run composes and validates every case of every piece as
a run on a hypothetical CUDA machine (with the case's packages and GPUs), the techniques
script takes the flags it is given, and a real run refuses to start without CUDA."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from memlab_testing import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acceptance():
    spec = importlib.util.spec_from_file_location(
        "gpu_acceptance", REPO / "benchmarks" / "gpu_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_piece_composes_and_validates_for_a_cuda_machine(acceptance, capsys):
    assert acceptance.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    cases = [(p.name, c.name) for p in acceptance.PIECES for c in p.cases]
    assert len(cases) >= 30 and out.count(" valid") == len(cases) + 1  # + the techniques run
    assert "INVALID" not in out
    names = {p.name for p in acceptance.PIECES}
    assert {"attention", "liger", "qlora", "offload", "precision", "varlen", "vllm",
            "distributed", "techniques"} <= names
    assert all(p.minutes <= 9 for p in acceptance.PIECES)
    assert sum(p.minutes for p in acceptance.PIECES) <= 25 - 3  # + the machine's start (~2)


def test_a_real_run_refuses_without_cuda(acceptance, capsys):
    assert acceptance.main(["--only", "offload"]) == 2
    assert "refuses to run without a CUDA device" in capsys.readouterr().out
