"""The tiers together select every test, once (tests/tiers.py), and `make test` runs them all."""

from __future__ import annotations

import itertools
import re

from memlab_testing import REPO
from tiers import CHECK_LIMIT_S, CHECK_WALL_S, MARKERS, TIERS, check_limit_problem, cpu_s, tier_of


def test_every_combination_of_markers_is_in_exactly_one_tier():
    for n in range(len(MARKERS) + 1):
        for markers in itertools.combinations(MARKERS, n):
            assert len(tier_of(set(markers))) == 1, (markers, tier_of(set(markers)))
    assert tier_of(set()) == ["check"]
    assert tier_of({"pipeline"}) == ["main"] and tier_of({"gpu", "pipeline"}) == ["gpu"]


def test_make_test_runs_every_tier_and_make_check_the_first():
    script = (REPO / "scripts" / "test.sh").read_text()
    ran = set(re.findall(r"\$\(tier (\w+)\)", script))
    assert ran == set(TIERS), ran
    assert "make test" in (REPO / ".ci" / "run").read_text()
    make = (REPO / "Makefile").read_text()
    assert "bash scripts/test.sh" in make
    assert re.search(r"^check:.*\n(\t.*\n)*\t.*tests/tiers\.py check", make, re.M)
    # given apart, an existing durations file is taken for a test path before tests/conftest.py
    # (which defines the option) loads: the second `make check` in a checkout was refused
    for text in (script, make):
        assert "--durations-file " not in text and "--durations-file=" in text


def test_the_check_tier_limits_cpu_time_and_waiting_not_the_machines_load():
    """A check test fails over 5 s of CPU, or over 15 s of wall time times the load per core
    (a test that waits): 8.8 s of wall time for 0.2 s of CPU (a test of 0.17 s alone, at load
    8) is the machine's load, not the test's. The CPU counted includes children the test
    waited for."""
    import subprocess
    import sys

    assert check_limit_problem("t", 0.2, 8.8) is None
    assert check_limit_problem("t", CHECK_LIMIT_S, CHECK_WALL_S) is None
    assert "5.5 s of CPU in 6.0 s" in check_limit_problem("t", 5.5, 6.0)
    assert "0.1 s of CPU in 16.0 s" in check_limit_problem("t", 0.1, 16.0)
    assert check_limit_problem("t", 1.3, 24.9, load=6.0) is None  # load 12 on 2 cores
    assert "90 s of wall time" in check_limit_problem("t", 1.3, 91.0, load=6.0)
    before = cpu_s()
    subprocess.run([sys.executable, "-S", "-c",
                    "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"],
                   check=True)
    assert cpu_s() - before >= 0.25
