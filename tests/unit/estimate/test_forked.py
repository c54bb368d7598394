"""memlab.estimate.forked: a function run in a forked child, its result back through a file; a
failure reported (the caller then measures that build itself); a stopped child reaped, its file
removed."""

from __future__ import annotations

import os
import time

import pytest

from memlab.estimate.forked import Forked, ForkedFailed


def test_the_childs_result_comes_back_and_its_file_is_removed():
    job = Forked(lambda: {"pid": os.getpid(), "moments": [(1, 2, 3)] * 1000})
    out = job.result()
    assert out["pid"] != os.getpid() and len(out["moments"]) == 1000
    assert not os.path.exists(job.path)


def test_a_failing_child_reports_its_error():
    job = Forked(lambda: 1 // 0)
    with pytest.raises(ForkedFailed, match="ZeroDivisionError"):
        job.result()


def test_an_unpicklable_result_is_a_failure_not_a_hang():
    job = Forked(lambda: (lambda: None))
    with pytest.raises(ForkedFailed, match="no result"):
        job.result()


def test_a_stopped_child_is_killed_and_reaped():
    job = Forked(lambda: time.sleep(60))
    t = time.monotonic()
    job.stop()
    assert time.monotonic() - t < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(job.pid, os.WNOHANG)  # reaped: no such child any more
    assert not os.path.exists(job.path)
