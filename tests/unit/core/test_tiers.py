"""The tiers together select every test, once (tests/tiers.py), and `make test` runs them all."""

from __future__ import annotations

import itertools
import re

from memlab_testing import REPO
from tiers import MARKERS, TIERS, tier_of


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
