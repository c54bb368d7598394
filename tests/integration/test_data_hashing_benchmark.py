"""benchmarks/data_hashing.py (what hashing data and model files costs) cannot rot: its dry run
runs every case on tiny files and writes its table and JSON."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from memlab_testing import REPO

pytestmark = pytest.mark.integration


def test_the_dry_run_measures_every_case(tmp_path, capsys):
    import datasets

    spec = importlib.util.spec_from_file_location("data_hashing",
                                                  REPO / "benchmarks" / "data_hashing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cache = datasets.config.HF_DATASETS_CACHE
    out = tmp_path / "out.json"
    assert module.main(["--dry-run", "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    assert datasets.config.HF_DATASETS_CACHE == cache  # put back
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["data_mb"] < 3
    cases = result["cases"]
    assert {"data: sha256, warm", "data: sha256, cold", "data: load, cached",
            "model: sha256, cold", "model: load_file, cold"} <= set(cases)
    assert all(c["best_s"] > 0 for c in cases.values())
    assert "data: sha256, cold" in capsys.readouterr().out
