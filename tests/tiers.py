"""The test suite's tiers: which command runs which tests (issue 41).

Each tier is a pytest marker expression; together they select every test exactly once, whatever
markers it carries (``tests/unit/core/test_tiers.py`` checks it over every combination, and the
collection refuses a test outside its tier's folder). ``pytest`` with no arguments runs the
``check`` tier (``addopts`` in pyproject.toml); ``scripts/test.sh`` (``make test``, CI) runs
every tier with the expression printed by ``python tests/tiers.py <tier>``, which replaces the
one in ``addopts`` (the last ``-m`` wins).

- ``check``: builds no pipeline and answers in seconds; ``make check`` (with ruff and mypy) is
  the inner loop. Enforced at run time (tests/conftest.py): a test of this tier fails when it
  builds a pipeline (its own process or one it spawns) or takes over :data:`CHECK_LIMIT_S` of
  CPU (:data:`CHECK_WALL_S` of wall time).
- ``main``: runs, estimates, sweeps, launches (``pipeline``: every test outside tests/unit, and
  the tests in tests/unit marked so), and ``slow`` ones.
- ``cpu_kernels``: Liger in Triton's interpreter, bitsandbytes on CPU (their own packages,
  tests/cpu_kernels); ``vllm``: vLLM's own environment (tests/generation); ``gpu``: a CUDA
  device (tests/gpu; skipped with the reason on a CPU).
"""

from __future__ import annotations

import sys
from pathlib import PurePosixPath

MARKERS = ("pipeline", "slow", "cpu_kernels", "vllm", "gpu")
"""The markers the tiers are drawn on."""

TIERS: dict[str, str] = {
    "check": "not (pipeline or slow or gpu or vllm or cpu_kernels)",
    "main": "(pipeline or slow) and not (gpu or vllm or cpu_kernels)",
    "cpu_kernels": "cpu_kernels and not (gpu or vllm)",
    "vllm": "vllm and not gpu",
    "gpu": "gpu",
}
"""Tier -> its marker expression, in the order ``make test`` runs them."""

FOLDER: dict[str, str] = {"cpu_kernels": "tests/cpu_kernels", "vllm": "tests/generation"}
"""The tiers that run in their own environment collect only their folder (a collection of the
whole suite there would import every test module): a test of theirs must live in it."""

UNIT = "tests/unit"
"""Tests outside this folder build pipelines: they are marked ``pipeline`` at collection."""

CHECK_LIMIT_S = 5.0
"""The most CPU a ``check`` test's call may take (its process's threads and the children it
waited for): what it takes on an idle core, whatever else loads the machine. At load 5-8 on 2
cores the wall clock of tests that take 0.2-4 s alone went to 8-17 s."""

CHECK_WALL_S = 15.0
"""The longest a ``check`` test's call may take in wall time on an idle machine, scaled by how
loaded the machine is (the 1-minute load average per core, when over 1): a test that waits (a
sleep, a process it does not wait for) fails here though its CPU time is small; one that only
shares the cores does not (at load 12 on 2 cores, 1.3 s of CPU took 25 s)."""


def cpu_s() -> float:
    """CPU seconds of this process (every thread) and of its children that ended and were
    waited for (user + system)."""
    import resource
    import time

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def load_per_core() -> float:
    """The 1-minute load average per core."""
    import os

    return os.getloadavg()[0] / (os.cpu_count() or 1)


def check_limit_problem(nodeid: str, cpu_s: float, wall_s: float,
                        load: float = 1.0) -> str | None:
    """Why a ``check`` test whose call took ``cpu_s`` of CPU in ``wall_s`` at ``load``
    (:func:`load_per_core`) fails, or None."""
    load = max(1.0, load)  # (an idle machine's)
    wall_limit = CHECK_WALL_S * load
    if cpu_s <= CHECK_LIMIT_S and wall_s <= wall_limit:
        return None
    return (f"{nodeid} took {cpu_s:.1f} s of CPU in {wall_s:.1f} s, over the check tier's "
            f"{CHECK_LIMIT_S:.0f} s of CPU or {wall_limit:.0f} s of wall time at a load of "
            f"{load:.1f} a core (tests/tiers.py): make it faster or mark it pytest.mark.pipeline "
            "(the main tier)")


def tier_of(markers: set[str]) -> list[str]:
    """The tiers whose expression selects a test with these markers (one, by construction)."""
    from _pytest.mark.expression import Expression

    return [name for name, expr in TIERS.items()
            if Expression.compile(expr).evaluate(lambda m, **_: m in markers)]


def folder_problem(path: str, tier: str) -> str | None:
    """Why a test at ``path`` (relative to the repo) cannot be in ``tier``, or None."""
    folder = FOLDER.get(tier)
    if folder and not PurePosixPath(path).is_relative_to(folder):
        return (f"{path}: a {tier} test runs in its own environment, which collects {folder} "
                "alone; move it there")
    return None


if __name__ == "__main__":  # scripts/test.sh: the expression of a tier
    print(TIERS[sys.argv[1]])
