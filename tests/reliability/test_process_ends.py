"""How a whole process ends: ``memlab`` stopped by SIGTERM writes its summary and its table and
exits 143; a rank of a multi-process run killed with SIGKILL makes the run ``killed`` (the other
rank's errors are consequences), with what rank 0 measured before."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from memlab_testing import check_record, run_job
from reliability.helpers import (
    HANG_S,
    SMOKE,
    memlab_popen,
    pause_env,
    release,
    wait_for_marker,
)

pytestmark = pytest.mark.integration


def test_sigterm_to_memlab_writes_summary_and_table_then_exits_143(tmp_path):
    pause, log, run_dir = tmp_path / "pause", tmp_path / "run.log", tmp_path / "run"
    proc = memlab_popen([*SMOKE, f"hydra.run.dir={run_dir}"], log,
                        env={"MEMLAB_PAUSE_AT": "data", "MEMLAB_PAUSE_DIR": str(pause)})
    try:
        wait_for_marker(pause, "data", proc, log)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert code == 143, out[-3000:]
    s = check_record(run_dir / "summary.json")
    assert s["status"] == "interrupted" and s["signal"] == "SIGTERM"
    assert "status: interrupted  (interrupted by SIGTERM before training started)" in out


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_makes_the_run_killed(tmp_path, monkeypatch):
    pause = tmp_path / "pause"
    pause_env(monkeypatch, pause, "step:1")

    def kill_rank_1():
        deadline = time.monotonic() + HANG_S
        while len(list(pause.glob("step:1.*.json"))) < 2:  # both ranks paused after step 1
            assert time.monotonic() < deadline, "hang guard"
            time.sleep(0.05)
        ranks = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["pid"]
                 for p in pause.glob("step:1.*.json")}
        os.kill(ranks[1], signal.SIGKILL)
        release(pause, "step:1")

    t = threading.Thread(target=kill_rank_1, daemon=True)
    t.start()
    s = run_job(tmp_path, [*SMOKE, "distributed=ddp", "distributed.nproc=2"], fast=False)
    t.join()
    assert s["status"] == "killed", s["error"]
    assert s["signal"] == "SIGKILL" and s["error"].startswith("RankFailed: rank 1 killed:")
    ranks = s["distributed"]["ranks"]
    assert ranks[1] is None and s["distributed"]["exit_codes"][1] == -signal.SIGKILL
    assert ranks[0]["status"] in ("failed", "interrupted")  # a consequence, not the cause
    assert s["train"]["steps"] >= 1 and s["memory"]["peak_bytes"] > 0  # rank 0's record


def _running(pid: int) -> bool:
    """A thread of the process is not yet a zombie (a leader that is a zombie while its other
    threads still exit holds its files all the same)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except FileNotFoundError:
            continue
    return False


def _paused_ranks(pause, proc, log, deadline: float) -> list[int]:
    """The pids of both ranks once each is paused at ``step:1`` (fails at once if ``proc``
    ended first)."""
    wait_for_marker(pause, "step:1", proc, log)
    while len(list(pause.glob("step:1.*.json"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    return [json.loads(p.read_text())["pid"] for p in pause.glob("step:1.*.json")]


def _until_gone(pids: list[int], deadline: float, outlived: str) -> None:
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, f"hang guard: the ranks outlived {outlived}"
        time.sleep(0.05)


def _kill_left(proc, pids: list[int]) -> None:
    """What a failed test leaves running: the process it started, and the ranks."""
    if proc.poll() is None:
        proc.kill()
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_ranks_hold_the_lock_and_end_with_a_launcher_killed_by_sigkill(tmp_path):
    """``kill -9`` of the process that started two DDP ranks: the ranks hold the run dir's
    lock while they live (the same open lock file), stop within their grace (recording
    ``interrupted``) instead of training on as orphans, and the lock is free once they are
    gone."""
    import fcntl

    pause, log, run_dir = tmp_path / "pause", tmp_path / "run.log", tmp_path / "run"
    proc = memlab_popen([*SMOKE, "distributed=ddp", "distributed.nproc=2",
                         f"hydra.run.dir={run_dir}"], log,
                        env={"MEMLAB_PAUSE_AT": "step:1", "MEMLAB_PAUSE_DIR": str(pause)})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + HANG_S
        pids = _paused_ranks(pause, proc, log, deadline)
        lock = str((run_dir / ".memlab.lock").resolve())
        for pid in pids:  # each rank holds the lock file open (the launcher's locked file)
            fds = os.listdir(f"/proc/{pid}/fd")
            assert lock in {os.path.realpath(f"/proc/{pid}/fd/{fd}") for fd in fds}, pid
        proc.kill()
        proc.wait(timeout=HANG_S)
        _until_gone(pids, deadline, "the launcher")
    finally:
        _kill_left(proc, pids)
        release(pause, "step:1")
    for r in range(2):
        rec = json.loads((run_dir / "ranks" / f"rank{r}.json").read_text())
        assert rec["status"] == "interrupted" and rec["signal"] == "SIGTERM"
    with open(run_dir / ".memlab.lock") as f:  # free once they are gone (the kernel drops
        while True:  # a dead process's files a moment after its threads are all zombies)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, (
                    f"hang guard: the lock is held after the ranks ended: "
                    f"{_holders(run_dir / '.memlab.lock')}")
                time.sleep(0.05)


def _holders(path) -> list[str]:
    """The processes that have ``path`` open (pid, state, command line)."""
    want, found = os.path.realpath(path), []
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        found += [line.strip() for line in f if f":{ino} " in line]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == want
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    cmd = c.read().replace(b"\0", b" ").decode()[:200]
                found.append(f"{pid} running={_running(int(pid))}: {cmd}")
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("grace", [["hydra.launcher.stop_grace_s=2"], []],
                         ids=["short grace", "default grace"])
def test_a_sweeps_stop_reaches_the_ranks_of_its_job(tmp_path, grace):
    """SIGTERM to a sweep whose job runs two DDP ranks, with a short grace
    (``hydra.launcher.stop_grace_s=2``) and the default one (30 s): the job records
    ``interrupted`` and no rank is left running (they end with their job, stopped by it or,
    past the grace, by their watch on it)."""
    pause, log, sweep = tmp_path / "pause", tmp_path / "sweep.log", tmp_path / "sweep"
    proc = memlab_popen(["-m", *SMOKE, "distributed=ddp", "distributed.nproc=2",
                         *grace, f"hydra.sweep.dir={sweep}",
                         "+hydra.launcher.env.MEMLAB_PAUSE_AT=step:1",
                         f"+hydra.launcher.env.MEMLAB_PAUSE_DIR={pause}"], log)
    pids: list[int] = []
    deadline = time.monotonic() + HANG_S
    try:
        pids = _paused_ranks(pause, proc, log, deadline)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_S)
        _until_gone(pids, deadline, "the sweep")
    finally:
        _kill_left(proc, pids)
    s = check_record(sweep / "0" / "summary.json")
    assert s["status"] == "interrupted", s["error"]
