"""A file holds one job: no source file under src/ is over 500 lines (split a longer one by its
jobs, as run.py was into run / record / the launch modes)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src"
MOST = 500


def test_no_source_file_is_over_500_lines():
    sizes = {p: len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert len(sizes) > 100  # the walk sees the package (memlab and hydra_plugins)
    long = sorted(f"{p.relative_to(SRC)}: {n} lines" for p, n in sizes.items() if n > MOST)
    assert not long, "split by job:\n  " + "\n  ".join(long)
