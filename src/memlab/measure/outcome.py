"""How a run ended: the statuses of summary.json, stop signals, evidence of the OOM killer.

A run records one of :data:`STATUSES`. The run itself tells ``ok``, ``invalid`` (a config,
data, model-file or checkpoint problem, found before anything loads where it can be, or while
the data is prepared or the files are read; the error names the file), ``oom`` (an allocation
failed),
``nan`` (a non-finite loss: the step is recorded), ``failed`` (any other exception: a bug or a
broken environment) and ``interrupted`` (SIGINT, SIGTERM or SIGHUP, with the signal). Its
launcher tells what the run cannot: ``timeout`` (stopped after the launcher's time limit), ``killed`` (SIGKILL,
or another fatal signal, from outside), ``oom`` again when a SIGKILL comes with evidence of the
OS out-of-memory killer (:class:`OomWatch`), and ``not_run`` (a sweep job never started because
the sweep was interrupted).

This module is light (no torch): the sweep launcher imports it.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

STATUSES = ("ok", "oom", "invalid", "nan", "failed", "killed", "timeout", "interrupted",
            "not_run")
"""Every status a summary can hold, in the order counts are printed."""

FAILING = ("failed", "killed")
"""Statuses that make a sweep exit non-zero: a crash or an unexplained kill needs a look (oom,
invalid, nan and timeout are results of the configuration)."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a run cleanly: it records ``interrupted`` with what it measured so far.
SIGHUP (the terminal or the SSH session closed) is one: its default would end the run without a
record and lose every measured step."""


class Interrupted(BaseException):
    """A stop signal arrived (SIGINT: Ctrl-C; SIGTERM: ``kill``, ``timeout``, SLURM, ``docker
    stop``; SIGHUP: the terminal closed). A BaseException, like KeyboardInterrupt, so that
    ``except Exception`` in library code does not swallow it."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.signal = signal.Signals(self.signum).name
        super().__init__(f"interrupted by {self.signal}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process stopped by this signal (130 for SIGINT)."""
        return 128 + self.signum


def count_line(statuses: Iterable[str]) -> str:
    """``"7 jobs: 2 ok, 1 oom, 1 invalid, 1 failed, 1 timeout, 1 not_run"`` (known statuses in
    :data:`STATUSES` order, then any other)."""
    counts: dict[str, int] = {}
    for s in statuses:
        counts[str(s)] = counts.get(str(s), 0) + 1
    n = sum(counts.values())
    order = [s for s in STATUSES if s in counts] + sorted(set(counts) - set(STATUSES))
    parts = ", ".join(f"{counts[s]} {s}" for s in order)
    return f"{n} job{'s' if n != 1 else ''}" + (f": {parts}" if parts else "")


class NonFiniteLoss(FloatingPointError):
    """The loss of optimizer step ``step`` (counted from 1) is NaN or infinite."""

    def __init__(self, step: int, value: float):
        self.step, self.value = int(step), float(value)
        super().__init__(f"loss is {value} at step {step}; lower train.lr or check the data")


class StopSignals:
    """Stop signals (:data:`STOP_SIGNALS`) for the code that records a run.

    While entered (in the main thread) a stop signal is *held*: remembered in ``held``, not
    raised, so that the record being made is made whole; the caller honours it afterwards.
    Inside :meth:`live` (the run itself) a stop signal raises :class:`Interrupted` where the main
    thread is, and one held before ``live`` is raised on entering it. Entered outside the main
    thread it does nothing (Python delivers signals to the main thread only). The previous
    handlers come back on exit."""

    def __init__(self) -> None:
        self.held: Interrupted | None = None
        self._live = False
        self._saved: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._saved.items():
            # None: the old handler was not installed from Python; the default stands for it
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        self._saved.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._live:
            raise Interrupted(signum)
        self.held = self.held or Interrupted(signum)

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        """Stop signals raise :class:`Interrupted` inside (a held one at once)."""
        if self.held is not None:
            held, self.held = self.held, None
            raise held
        self._live = True
        try:
            yield
        finally:
            self._live = False


# ------------------------------------------------------------------ the OS out-of-memory killer

CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_cgroups(pid: int, root: Path = CGROUP_ROOT) -> list[Path]:
    """The memory cgroup directories of process ``pid`` and of their ancestors (cgroup v2's
    unified hierarchy and v1's ``memory`` controller; a limit may sit on any ancestor)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return []
    out: list[Path] = []
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            bases = [root, root / "unified"]
        elif "memory" in controllers.split(","):
            bases = [root / "memory"]
        else:
            continue
        rel = Path(path.lstrip("/"))
        for base in bases:
            for d in [base / rel, *(base / p for p in rel.parents)]:
                if (d / "memory.events").exists() or (d / "memory.oom_control").exists():
                    if d not in out:
                        out.append(d)
    return out


def oom_kills(cgroup: Path) -> int | None:
    """The ``oom_kill`` counter of a memory cgroup (v2 ``memory.events``, v1
    ``memory.oom_control``); None when it has none."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (cgroup / name).read_text()
        except OSError:
            continue
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        if m:
            return int(m.group(1))
    return None


def kernel_log_oom(pid: int, since: float | None = None, log: str | None = None) -> str | None:
    """The kernel log's line saying that the OOM killer killed ``pid`` (``dmesg``; None when
    there is none or the log cannot be read). ``since``: ignore lines stamped before this
    ``time.monotonic()`` value (the kernel stamps its log with seconds since boot; an older
    line is about another process that had the same pid)."""
    if log is None:
        try:
            log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    pat = re.compile(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)")
    for line in reversed(log.splitlines()):
        if not pat.search(line):
            continue
        stamp = re.match(r"\s*\[\s*(\d+\.\d+)\]", line)
        if since is not None and stamp and float(stamp.group(1)) < since - 1.0:
            continue
        return line.strip()
    return None


class OomWatch:
    """Evidence that the OS out-of-memory killer ended a process: its memory cgroups' ``oom_kill``
    counters rose while it ran, or the kernel log names it. :meth:`observe` while the process
    runs (its first call sets the baselines; a cgroup the process moves into later is added
    with its own), :meth:`evidence` once it died of SIGKILL."""

    def __init__(self, pid: int, root: Path = CGROUP_ROOT):
        self.pid, self.root = pid, root
        self.started = time.monotonic()
        self.baseline: dict[Path, int] = {}
        self.observe()

    def observe(self) -> None:
        for d in memory_cgroups(self.pid, self.root):
            if d not in self.baseline:
                n = oom_kills(d)
                if n is not None:
                    self.baseline[d] = n

    def evidence(self, kernel_log: str | None = None) -> str | None:
        """What shows the OOM killer at work, in words (None: no evidence)."""
        found = []
        for d, before in self.baseline.items():
            after = oom_kills(d)
            if after is not None and after > before:
                name = "memory.events" if (d / "memory.events").exists() else "memory.oom_control"
                found.append(f"{d / name}: oom_kill {before} -> {after}")
        line = kernel_log_oom(self.pid, self.started, kernel_log)
        if line:
            found.append(f"kernel log: {line}")
        return "; ".join(found) or None


def killed_status(signum: int, watch: OomWatch | None) -> tuple[str, str]:
    """``(status, reason)`` of a process that died of signal ``signum`` without recording its
    end: SIGKILL is ``oom`` with the evidence when :class:`OomWatch` has some, ``killed``
    otherwise; SIGINT / SIGTERM / SIGHUP before the run could record them ``interrupted``; any
    other (SIGSEGV, SIGABRT, SIGBUS...) a crash: ``failed``."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == signal.SIGKILL:
        evidence = watch.evidence() if watch is not None else None
        if evidence:
            return "oom", f"killed by SIGKILL from the OS out-of-memory killer ({evidence})"
        return "killed", ("killed by SIGKILL (no sign of the out-of-memory killer in the "
                          "cgroup counters or the kernel log: killed by someone)")
    if signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        return "interrupted", f"stopped by {name} before it could record anything"
    return "failed", f"crashed: killed by {name}"
