"""Fault injection for memlab's reliability tests, and the test suite's guard: explicit,
documented environment variables read at a few named points of a run. Nothing else in memlab
reads them, and unset (always, outside tests) a point costs one dictionary lookup.

``MEMLAB_PAUSE_AT=<point>``
    At ``<point>`` the run writes ``$MEMLAB_PAUSE_DIR/<point>.<pid>.json`` (``{"point", "pid",
    "rank"}``) and waits until ``$MEMLAB_PAUSE_DIR/<point>.go`` exists. A test waits for the
    marker, does what it tests (sends a signal, kills the process, makes the run dir unwritable)
    and then releases the run, so the run is at a known place without any sleep or timing luck.
``MEMLAB_FAULT_AT=<point>``
    At ``<point>`` the run raises :class:`InjectedFault` (a crash stand-in: status ``failed``).

``MEMLAB_TEST_EVENTS=<dir>``
    The test suite's guard (tests/conftest.py): at a few named events a process appends one line,
    ``<event>``, to ``<dir>/<pid>.events``, so the suite can tell which test made a process (its
    own, or one it spawned) resolve ``precision=auto`` on this machine's CPU (``precision=auto``)
    or build a run's pipeline (``pipeline``). It changes nothing a run does.

``MEMLAB_PAUSE_AT`` without ``MEMLAB_PAUSE_DIR`` (a hook left in a shell's environment) would
wait forever for a file nobody creates: a run refuses it before anything loads
(:func:`problems`, status ``invalid``), and :func:`reach` raises rather than wait.

Points: ``check:rank<r>`` (rank ``r`` of a torchrun launch, before it checks the config),
``data`` (data preparation, before the source is read), ``step:<n>`` (after optimizer
step ``n`` is done and recorded; steps count from 1), ``checkpoint`` (before a checkpoint is
written), ``summary`` (before summary.json is written; stop signals are held there, so a signal
sent while a run waits at ``summary`` is honoured after the record is written).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PAUSE_AT = "MEMLAB_PAUSE_AT"
PAUSE_DIR = "MEMLAB_PAUSE_DIR"
FAULT_AT = "MEMLAB_FAULT_AT"
EVENTS = "MEMLAB_TEST_EVENTS"


class InjectedFault(RuntimeError):
    """Raised at ``MEMLAB_FAULT_AT``'s point."""


def problems() -> list[str]:
    """What is wrong with the fault hooks of this process's environment (checked with the
    configuration, before anything loads): a pause point without a pause dir."""
    point = os.environ.get(PAUSE_AT)
    if point and not os.environ.get(PAUSE_DIR):
        return [f"{PAUSE_AT}={point} is set without {PAUSE_DIR}: the run would wait forever at "
                f"{point} (a test hook of memlab's reliability suite, memlab/faults.py); unset "
                f"{PAUSE_AT}, or set {PAUSE_DIR} to the directory where a test releases it"]
    return []


def note(event: str) -> None:
    """Record ``event`` for the test suite's guard (``MEMLAB_TEST_EVENTS``); nothing when unset."""
    where = os.environ.get(EVENTS)
    if not where:
        return
    try:
        with open(Path(where) / f"{os.getpid()}.events", "a") as f:
            f.write(event + "\n")
    except OSError:  # the suite's dir is gone (a process that outlived its test): nothing to tell
        pass


def reach(point: str) -> None:
    """Called by the run at ``point``: pause or fail there when a test asked for it."""
    if os.environ.get(FAULT_AT) == point:
        raise InjectedFault(f"fault injected at {point} (MEMLAB_FAULT_AT)")
    if os.environ.get(PAUSE_AT) != point:
        return
    if not os.environ.get(PAUSE_DIR):
        raise InjectedFault(problems()[0])
    where = Path(os.environ[PAUSE_DIR])
    where.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("MEMLAB_RANK") or os.environ.get("RANK") or "0"
    marker = where / f"{point}.{os.getpid()}.json"
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"point": point, "pid": os.getpid(), "rank": int(rank)}))
    os.replace(tmp, marker)  # the test never reads half a marker
    go = where / f"{point}.go"
    while not go.exists():
        time.sleep(0.01)  # a stop signal interrupts the sleep and is handled at once
