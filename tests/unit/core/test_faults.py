"""The reliability suite's hooks in a run (:mod:`memlab.faults`): where they are not set or their
place is gone, a run goes on untouched; a pause point without its directory is an error, not a
wait that never ends."""

from __future__ import annotations

import os

import pytest

from memlab import faults


def test_events_go_to_the_suites_dir_and_nowhere_without_it(monkeypatch, tmp_path):
    monkeypatch.delenv(faults.EVENTS, raising=False)
    faults.note("not asked for")  # no dir named: nothing written, no error
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(faults.EVENTS, str(tmp_path / "gone"))  # outlived its test's dir
    faults.note("too late")
    assert not (tmp_path / "gone").exists()
    monkeypatch.setenv(faults.EVENTS, str(tmp_path))
    faults.note("told")
    assert (tmp_path / f"{os.getpid()}.events").read_text() == "told\n"


def test_a_pause_point_without_its_dir_fails_instead_of_waiting(monkeypatch):
    monkeypatch.setenv(faults.PAUSE_AT, "step:1")
    monkeypatch.delenv(faults.PAUSE_DIR, raising=False)
    assert faults.problems() and faults.PAUSE_DIR in faults.problems()[0]
    faults.reach("step:2")  # another point: goes on
    with pytest.raises(faults.InjectedFault, match=faults.PAUSE_DIR):
        faults.reach("step:1")
