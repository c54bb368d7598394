"""A SIGKILL is ``oom`` only with evidence of the OS out-of-memory killer (a memory cgroup's
``oom_kill`` counter rose, or the kernel log names the process), ``killed`` otherwise; the
evidence is named. Unit checks on a cgroup tree laid out like the real one, and a real OOM kill
under a cgroup memory limit where this machine lets a test create one (root, a writable memory
controller)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memlab.measure.outcome import (
    OomWatch,
    kernel_log_oom,
    killed_status,
    memory_cgroups,
    oom_kills,
)
from reliability.helpers import ENV, SMOKE


def _fake_tree(root: Path, pid: int) -> list[Path]:
    """``root`` laid out like /sys/fs/cgroup for ``pid``'s cgroups (v1 memory and v2), every
    ``oom_kill`` counter at 0; returns the counter files."""
    files = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            d, name, text = root / path.lstrip("/"), "memory.events", "low 0\noom 0\noom_kill 0\n"
        elif "memory" in controllers.split(","):
            d, name = root / "memory" / path.lstrip("/"), "memory.oom_control"
            text = "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"
        else:
            continue
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
        files.append(d / name)
    return files


def test_a_rising_cgroup_counter_is_named_as_evidence(tmp_path):
    files = _fake_tree(tmp_path, os.getpid())
    assert files, "this process has no cgroup lines"
    watch = OomWatch(os.getpid(), root=tmp_path)
    assert set(watch.baseline.values()) == {0}
    assert watch.evidence(kernel_log="") is None
    assert killed_status(signal.SIGKILL, watch)[0] == "killed"
    files[0].write_text(files[0].read_text().replace("oom_kill 0", "oom_kill 1"))
    evidence = watch.evidence(kernel_log="")
    assert evidence == f"{files[0]}: oom_kill 0 -> 1"
    status, why = killed_status(signal.SIGKILL, watch)
    assert status == "oom" and evidence in why
    assert memory_cgroups(os.getpid(), tmp_path)[0] == files[0].parent
    assert oom_kills(files[0].parent) == 1


def test_the_kernel_log_names_the_process_and_old_lines_do_not_count():
    pid = 424242
    now = time.monotonic()
    log = (f"[{now / 2:.6f}] Out of memory: Killed process {pid} (python) total-vm:1kB\n"
           f"[{now + 1:.6f}] Memory cgroup out of memory: Killed process {pid} (python)\n"
           f"[{now + 2:.6f}] Out of memory: Killed process {pid}1 (other)\n")
    assert "Memory cgroup out of memory" in kernel_log_oom(pid, since=now, log=log)
    assert kernel_log_oom(pid, since=now, log=log.splitlines()[0]) is None  # another life
    assert kernel_log_oom(pid + 1, since=now, log=log) is None


def test_other_deaths():
    assert killed_status(signal.SIGKILL, None)[0] == "killed"
    assert killed_status(signal.SIGTERM, None)[0] == "interrupted"
    assert killed_status(signal.SIGSEGV, None) == ("failed", "crashed: killed by SIGSEGV")


def _memory_cgroup_we_may_limit() -> Path | None:
    """A memory cgroup dir under this process's own where a child with a limit can be made."""
    if os.geteuid() != 0:
        return None
    for d in memory_cgroups(os.getpid()):
        limit = "memory.limit_in_bytes" if (d / "memory.limit_in_bytes").exists() else (
            "memory.max")
        if (d / limit).exists() and os.access(d, os.W_OK):
            return d
    return None


@pytest.mark.integration
@pytest.mark.slow
def test_a_job_killed_by_the_oom_killer_under_a_cgroup_limit_is_oom(tmp_path):
    parent = _memory_cgroup_we_may_limit()
    if parent is None:
        pytest.skip("no memory cgroup this test may create a child in (needs root and a "
                    "writable memory controller)")
    group = parent / f"memlab-test-{os.getpid()}"
    v1 = (parent / "memory.limit_in_bytes").exists()
    limit = 1 << 30  # the job's model alone needs ~4.4 GiB: it cannot fit
    wrapper = tmp_path / "in_cgroup.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"mkdir -p {group}\n"
        f"echo {limit} > {group}/{'memory.limit_in_bytes' if v1 else 'memory.max'}\n"
        f"echo $$ > {group}/cgroup.procs\n"
        f'exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    sweep = tmp_path / "sweep"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "memlab", "-m", *SMOKE, "train.steps=1",
             "model.hidden_size=8192", "model.intermediate_size=32768", "model.num_heads=64",
             "model.num_kv_heads=8", f"hydra.launcher.python={wrapper}",
             f"hydra.sweep.dir={sweep}"],
            env=ENV, capture_output=True, text=True, timeout=600)
    finally:
        if group.exists():
            for _ in range(50):  # the killed process leaves the group as it is reaped
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
    s = json.loads((sweep / "0" / "summary.json").read_text())
    assert s["status"] == "oom", (s["error"], r.stdout[-2000:], r.stderr[-2000:])
    assert s["signal"] == "SIGKILL" and "out-of-memory killer" in s["error"]
    assert "oom_kill 0 -> 1" in s["error"] or "Killed process" in s["error"], s["error"]
    assert r.returncode == 0  # an oom is a result, not a crash
    assert "1 job: 1 oom" in r.stdout
