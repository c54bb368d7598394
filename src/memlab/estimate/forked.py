"""A function run in a forked child process while the caller goes on; its result (plain,
picklable data) comes back through a file. :func:`memlab.estimate.fake.run_fake_step` measures
the shallower of :mod:`memlab.estimate.layers`' two builds this way, the deeper one in its own
process: the two at once on two cores (the same estimate: ``tests/unit/estimate/test_layers.py``).

The child inherits everything the caller has loaded (imports, torch's dispatch caches), as
``memlab fit``'s forked workers do, and runs one intra-op thread (:func:`fork_safe_threads`).
What it inherits is frozen for its garbage collector (:func:`frozen_heap`, Python's advice for
a fork): a collection in the child would walk, and so copy, every page of the caller's heap
(measured on Qwen2.5-0.5B: the child's shallower build took 4.7 s instead of 2.3 s).
It leaves through
``os._exit`` (no atexit handler or buffered output of the caller runs twice). A child that
fails, or whose caller is gone, says so instead of a result: the caller measures that build
itself.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any


def fork_safe_threads() -> None:
    """One intra-op thread for a forked process (a :class:`Forked` child, ``memlab fit``'s
    estimating workers): a parent that had started torch's OpenMP pool (a collator's ``nonzero``
    over a large batch) leaves a child whose next parallel op waits forever (GNU OpenMP is not
    fork-safe; seen on fit's 32-row Qwen2.5-0.5B candidates,
    ``tests/unit/cli/test_fit_workers.py``). With one thread torch runs every op inline, never
    entering an OpenMP region; the forked processes are the parallelism."""
    import torch

    torch.set_num_threads(1)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Every object alive on entry moved out of the garbage collector's reach until exit
    (``gc.freeze`` / ``gc.unfreeze``; a no-op inside another freeze).
    :func:`memlab.estimate.estimate` runs in one: a full collection then walks what the estimate made, not every module, tensor
    and config the process holds (0.4 s of the first Qwen2.5-0.5B estimate), and a forked child
    copies none of the caller's pages by collecting them. Nothing leaks: what was frozen is
    collected as before after exit."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class ForkedFailed(RuntimeError):
    """The child gave no result (its error, or how it ended)."""


class Forked:
    """``fn()`` running in a forked child: :meth:`result` waits for it, :meth:`stop` ends it."""

    def __init__(self, fn: Callable[[], Any]):
        fd, self.path = tempfile.mkstemp(prefix="memlab-estimate-", suffix=".pickle")
        os.close(fd)
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        with frozen_heap():  # the child's collections skip everything it inherits
            try:
                self.pid = os.fork()
            except OSError:
                _unlink(self.path)
                raise
            if self.pid == 0:  # the child: never returns
                _child(fn, self.path, parent)
        self.done = False

    def result(self) -> Any:
        """The child's result; :class:`ForkedFailed` where it has none."""
        _, status = os.waitpid(self.pid, 0)
        self.done = True
        try:
            with open(self.path, "rb") as f:
                kind, value = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            kind, value = "failed", f"the child process ended with status {status}, no result"
        finally:
            _unlink(self.path)
        if kind != "ok":
            raise ForkedFailed(value)
        return value

    def stop(self) -> None:
        """End the child (the caller failed or was interrupted) and reap it."""
        if self.done:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.done = True
        _unlink(self.path)


def _child(fn: Callable[[], Any], path: str, parent: int) -> None:
    code = 0
    try:
        fork_safe_threads()
        out: tuple[str, Any] = ("ok", fn())
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which measures itself
        out = ("failed", f"{type(e).__name__}: {e}")
    try:
        if os.getppid() != parent:  # the caller is gone: nobody reads the result
            _unlink(path)
        else:
            with open(path, "wb") as f:
                pickle.dump(out, f)
    except BaseException:  # noqa: BLE001
        code = 1
    os._exit(code)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
