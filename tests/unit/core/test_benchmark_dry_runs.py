"""The benchmarks cannot rot: every ``benchmarks/*.py`` that runs as a script has ``--dry-run``
(it composes and validates each case's memlab configuration and builds its commands without
running them), and each one's dry run passes here, in this process (the module imported by
path, its ``main(argv)`` called). The three with their own tests run there:
checkpoint_hashing (tests/reliability/test_checkpoint_integrity.py), data_hashing
(tests/integration/test_data_hashing_benchmark.py), gpu_acceptance
(tests/integration/test_gpu_acceptance.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

from memlab_testing import REPO

BENCHMARKS = REPO / "benchmarks"
TESTED_ELSEWHERE = {"checkpoint_hashing", "data_hashing", "gpu_acceptance"}
DRY_RUNS = ["chat_masks", "estimate", "estimate_speed", "experiments_estimate", "fit_search",
            "generation", "online", "packing", "preference_packing", "real_size", "techniques"]
MORE = {"real_size": ["--curves"]}
"""Options whose runs the plain dry run leaves out."""
SLOW = {"real_size"}
"""Dry runs that validate enough cases to pass the check tier's 5 s on loaded cores (real_size:
its memlab runs validated, 7.5 s at load 7 on 2 cores): the main tier."""


def scripts() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py")
                  if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M))


def load(name: str, monkeypatch):
    """benchmarks/<name>.py as a module (its directory on sys.path, as a script has it)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_script_has_a_dry_run_that_a_test_runs():
    found = scripts()
    assert set(DRY_RUNS) | TESTED_ELSEWHERE == set(found), (
        "a benchmark script is not run by a dry-run test: add it to DRY_RUNS here")
    lacking = [n for n in found if '"--dry-run"' not in (BENCHMARKS / f"{n}.py").read_text()]
    assert not lacking, f"benchmarks without --dry-run: {lacking}"


@pytest.mark.auto_precision("a dry run validates the benchmark's runs as they will run: "
                            "precision=auto where they leave it")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in DRY_RUNS])
def test_the_dry_run_passes(name, monkeypatch, capsys):
    env = dict(os.environ)
    try:
        rc = load(name, monkeypatch).main(["--dry-run", *MORE.get(name, [])])
    finally:  # (generation.py sets thread and logging variables when imported)
        for key in set(os.environ) - set(env):
            del os.environ[key]
    out = capsys.readouterr().out
    assert rc in (0, None) or isinstance(rc, dict), out  # packing's main returns its results
    assert f"[{name}] dry run: 0 invalid" in out, out
    assert "INVALID" not in out, out


@pytest.mark.auto_precision("the broken case is never built")
def test_a_case_that_does_not_validate_fails_the_dry_run_naming_it(monkeypatch, capsys):
    module = load("estimate", monkeypatch)
    monkeypatch.setattr(module, "CASES", {"renamed knob": ["method.no_such_knob=1"]})
    assert module.main(["--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "renamed knob" in out and "INVALID" in out and "no_such_knob" in out, out


def test_fit_searchs_comparison_finds_what_the_pruning_got_wrong(monkeypatch):
    """benchmarks/fit_search.py's check of a pruned search against the exhaustive one, on
    made-up records: none found where the pruned search agrees; a changed estimate, a stop whose
    need is above the exhaustive one's and a dominated candidate ranked before its pruner, each
    found."""
    compare = load("fit_search", monkeypatch).compare

    def est(fits: bool, peak: int) -> dict:
        return {"status": "ok", "peak_bytes": peak, "needed_bytes": peak, "fits": fits,
                "flops_per_step": 1, "predicted_s": 1.0, "offloaded_bytes_per_step": 0,
                "by_category": {}}

    def cand(label, estimate, rank=None, pruned=None):
        return {"label": label, "shared_with": None, "estimate": estimate,
                "predicted_rank": rank, "pruned": pruned}

    ex = {"candidates": [cand("a", est(True, 1), 1), cand("b", est(True, 2), 2),
                         cand("c", est(False, 9))], "search": {}}
    pr = {"candidates": [cand("a", est(True, 1), 1),
                         cand("b", None, pruned={"reason": "dominated", "by": 0}),
                         cand("c", {"status": "over_budget", "needed_at_least_bytes": 5,
                                    "fits": False})], "search": {}}
    assert compare(ex, pr)["problems"] == []
    pr["candidates"][0]["estimate"] = est(True, 3)
    pr["candidates"][2]["estimate"]["needed_at_least_bytes"] = 10
    ex["candidates"][0]["predicted_rank"], ex["candidates"][1]["predicted_rank"] = 2, 1
    found = compare(ex, pr)["problems"]
    assert any("a: peak_bytes 3 != 1" in p for p in found), found
    assert any(p.startswith("c: stopped over the budget") for p in found), found
    assert any("b: pruned by a, which ranks after it" in p for p in found), found
