"""The order xdist hands test files to its workers: the longest first (issue 41).

``scripts/test.sh`` runs each tier on 2 workers with ``--dist loadfile``: a file is one unit of
work, given to the next worker that runs low. xdist's own order (most tests first, or the
collection's) can leave the longest file for last, one worker running it alone while the other
waits: the tier's wall time is then that file's, not half the work. Handing out the longest
files first (the LPT rule) makes the two workers end within about one short file of each other.

How long each file takes comes from ``tests/weights.tsv`` (seconds per file, summed over its
tests, from a whole ``make test``), which ``python tests/schedule.py`` writes from the
``.test-durations/*.tsv`` files that ``scripts/test.sh`` keeps. A file missing there (new since)
counts :data:`UNKNOWN_S` a test. Stale weights only reorder the files: every test still runs
once, in its file's order (tests/conftest.py sorts whole files, stably).

    python tests/schedule.py    # after make test: rewrite tests/weights.tsv from its durations
    python tests/schedule.py tiers .test-durations/pytest.tsv   # each tier's wall time in it
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

HERE = Path(__file__).resolve().parent
WEIGHTS = HERE / "weights.tsv"
DURATIONS = HERE.parent / ".test-durations"
UNKNOWN_S = 1.0
"""Seconds a test of a file that ``weights.tsv`` does not list counts for."""

T = TypeVar("T")


def file_of(nodeid: str) -> str:
    """The file part of a test id (``tests/x/test_y.py::test_z[a::b]`` -> ``tests/x/test_y.py``)."""
    return nodeid.split("::", 1)[0]


def read_weights(path: Path = WEIGHTS) -> dict[str, float]:
    """File -> seconds, from a weights file (empty when there is none)."""
    if not path.exists():
        return {}
    with path.open() as f:
        return {row["file"]: float(row["seconds"]) for row in csv.DictReader(f, delimiter="\t")}


def longest_first(items: Sequence[T], file: dict[int, str], weights: dict[str, float],
                  first: frozenset[str] = frozenset()) -> list[T]:
    """``items`` grouped by file, the files ordered by their weight (longest first; a tie keeps
    the collection's order), each file's items in their own order. ``file`` maps an item's
    index to its file; the files in ``first`` (the check tier's, in a session that runs two
    tiers) come before all others, longest first among themselves."""
    groups: dict[str, list[T]] = {}
    for i, item in enumerate(items):
        groups.setdefault(file[i], []).append(item)

    def key(name: str) -> tuple[bool, float]:
        return name not in first, -weights.get(name, UNKNOWN_S * len(groups[name]))

    order = sorted(groups, key=key)  # stable: ties keep the collection's order
    return [item for name in order for item in groups[name]]


def weights_from(durations: Iterable[Path]) -> dict[str, float]:
    """Seconds per file, summed over its tests, from durations files (``scripts/test.sh``'s
    and ``make check``'s): a test in several files counts once, from the last one given."""
    seconds: dict[str, float] = {}
    for path in durations:
        with path.open() as f:
            seconds.update({row["test"]: float(row["seconds"])
                            for row in csv.DictReader(f, delimiter="\t")})
    total: dict[str, float] = {}
    for test, s in seconds.items():
        total[file_of(test)] = total.get(file_of(test), 0.0) + s
    return total


def write_weights(weights: dict[str, float], path: Path = WEIGHTS) -> None:
    rows = sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))
    path.write_text("seconds\tfile\n" + "".join(f"{s:.1f}\t{name}\n" for name, s in rows))


def tier_walls(path: Path) -> list[tuple[str, float]]:
    """Each tier of one session's durations file and its wall time: from the end of the tier
    before it (the session's start for the first) to the end of its own last test. A session
    that runs the check tier's files first (tests/conftest.py) ends that tier before the next
    begins, but for a file or so beside it."""
    last: dict[str, float] = {}
    with path.open() as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if row["outcome"] != "skipped":  # (the gpu tier's, on a CPU: skipped as they come)
                last[row["tier"]] = max(last.get(row["tier"], 0.0), float(row["ended"]))
    out, before = [], 0.0
    for tier, end in sorted(last.items(), key=lambda kv: kv[1]):
        out.append((tier, end - before))
        before = end
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["tiers"]:  # scripts/test.sh: the tiers of a session and their times
        print(", ".join(f"{tier} {s:.0f} s" for tier, s in tier_walls(Path(sys.argv[2]))))
        sys.exit()
    found = sorted(DURATIONS.glob("*.tsv"), key=lambda p: p.stat().st_mtime)  # newest last
    if not found:
        sys.exit(f"no durations in {DURATIONS}: run make test (scripts/test.sh) first")
    write_weights(weights_from(found))
    print(f"{WEIGHTS.relative_to(HERE.parent)}: {len(read_weights())} files, from "
          + ", ".join(p.name for p in found))
