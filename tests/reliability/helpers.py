"""Shared helpers of the fault-injection suite: wait at memlab's explicit test hooks
(``MEMLAB_PAUSE_AT`` / ``MEMLAB_PAUSE_DIR``, :mod:`memlab.faults`), act, release.

Nothing here sleeps for a result: a test waits until the run has written its marker (it is then
paused at a known point), does what it tests, and releases the run. The only time limits are
hang guards (``HANG_S``), far above any run's duration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from memlab.faults import FAULT_AT, PAUSE_AT, PAUSE_DIR
from memlab_testing import REPO

HANG_S = 600.0
"""A hang guard, not a timing assumption: a paused run waits for its test, never the reverse."""

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_SILENT": "true",
       "MEMLAB_CPU_BF16": "0",  # as in-process (tests/reliability/conftest.py): no precision here
       "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
for _hook in (PAUSE_AT, PAUSE_DIR, FAULT_AT):
    ENV.pop(_hook, None)

SMOKE = ["debug=smoke", "train.steps=3", "measure.memory_steps=1", "measure.warmup_steps=0",
         "data.n_examples=16",
         "method.max_length=64", "model.hidden_size=32", "model.intermediate_size=64",
         "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1"]
"""The smallest run that still measures memory and throughput (in-process and subprocess)."""


def wait_for_marker(pause_dir: Path, point: str, proc: subprocess.Popen | None = None,
                    log: Path | None = None) -> dict:
    """The marker of the run paused at ``point`` (``{"point", "pid", "rank"}``), once it exists;
    fails at once when ``proc`` ended first (its log in the message)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        found = sorted(Path(pause_dir).glob(f"{point}.*.json"))
        if found:
            return json.loads(found[0].read_text())
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"the process ended (code {proc.returncode}) before reaching "
                                 f"{point}:\n{tail}")
        time.sleep(0.05)
    raise AssertionError(f"hang guard: nothing reached {point} in {HANG_S:.0f} s")


def release(pause_dir: Path, point: str) -> None:
    """Let the run paused at ``point`` go on."""
    (Path(pause_dir) / f"{point}.go").touch()


def pause_env(monkeypatch, pause_dir: Path, point: str) -> None:
    """This process's runs pause at ``point`` (in-process tests)."""
    monkeypatch.setenv(PAUSE_AT, point)
    monkeypatch.setenv(PAUSE_DIR, str(pause_dir))


class AtPause(threading.Thread):
    """For in-process runs: once the run (in the main thread) is paused at ``point``, call
    ``action()`` and release the run. ``join()`` re-raises what the action raised."""

    def __init__(self, pause_dir: Path, point: str, action: Callable[[], None]):
        super().__init__(daemon=True)
        self.pause_dir, self.point, self.action = Path(pause_dir), point, action
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            wait_for_marker(self.pause_dir, self.point)
            self.action()
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e
        finally:
            release(self.pause_dir, self.point)

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def signal_main_thread(sig: int) -> Callable[[], None]:
    """An action that sends ``sig`` to this process's main thread (where Python handles it)."""
    main = threading.main_thread().ident
    return lambda: signal.pthread_kill(main, sig)


def memlab_popen(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``python -m memlab ARGS`` in the background, its output in ``log``."""
    out = open(log, "w")  # noqa: SIM115 - the child holds it; closed when the test ends
    return subprocess.Popen([sys.executable, "-m", "memlab", *args], cwd=REPO,
                            env={**ENV, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)


def limited_python(tmp: Path) -> Path:
    """An interpreter wrapper for ``hydra.launcher.python``: the job's Python under
    ``ulimit -v $REL_AS_LIMIT_KB`` (RLIMIT_AS) when that is set in the job's environment."""
    path = tmp / "limited_python.sh"
    path.write_text('#!/bin/sh\n[ -n "$REL_AS_LIMIT_KB" ] && ulimit -v "$REL_AS_LIMIT_KB"\n'
                    f'exec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return path
