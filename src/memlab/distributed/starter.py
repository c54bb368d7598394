"""How the ranks' processes start: forked from a fork server that imported memlab, torch,
transformers' models, peft and datasets once (:data:`PRELOAD`), instead of each rank importing
them again (~5 s of CPU a rank on a 2-core machine, about half of a short rank's life).

The server is multiprocessing's ``forkserver``: a fresh interpreter (never a fork of the run's
own process, whose threads and state a fork would copy) that the run's process starts on its
first launch and keeps for the next ones (a sweep's jobs, a test session's runs). Each rank is a
fork of it that then becomes what ``python -m <worker> RUN_DIR`` would be:

- nothing of the run's ``__main__``: multiprocessing would import the script that started the
  run into each child (a script without a ``__main__`` guard would start the run again in every
  rank); a rank is ``python -m <worker>``, so the parent's main module is left out of what the
  child prepares (:class:`_RankPopen`);
- the run's environment *as it is at the launch* (the server's is the one it started with; the
  rank's ``os.environ`` is replaced with the run's, plus its own rank variables), the run's
  working directory and ``sys.path`` (multiprocessing's preparation data), ``sys.argv``;
- its own session (``os.setsid``: a terminal's Ctrl-C reaches the run, which stops its ranks);
- bound to the run's process: when that process ends without stopping its ranks (``kill -9``,
  a sweep's stop that runs out of grace), each rank gets SIGTERM (it records ``interrupted``)
  instead of training on as an orphan (a thread waits on the run's pidfd; a rank that starts
  after the run is gone stops at once);
- holding the descriptors the run passes (its run dir's lock: the lock stays held until the
  last rank is gone);
- stdout / stderr: rank 0 the run's own (its file descriptors, passed to the rank), the others
  their log files;
- the worker module run as ``__main__`` (``runpy``), its ``sys.exit`` code the process's exit
  code; ``atexit`` handlers run as at a normal interpreter's end.

Where a CUDA device is present nothing is imported ahead: a fork of a process that touched the
CUDA driver (some imports ask for the device count) cannot use CUDA, so each rank imports for
itself there, as before (not run on a GPU yet: the GPU tier's distributed tests check it).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import popen_forkserver
from multiprocessing.context import ForkServerProcess
from typing import Any

PRELOAD = ("memlab.rank", "memlab.run", "memlab.pipeline", "transformers", "datasets",
           "hydra_plugins.memlab_launcher.worker", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama", "peft", "memlab.estimate.preload")
"""What the fork server imports before it forks (CPU machines only): a rank's modules, and a
sweep job's (the launcher forks its jobs from the same server). transformers loads its modules
lazily, so the package alone leaves ``modeling_utils`` (1.5 s, 1,060 modules) to each rank:
:mod:`memlab.estimate.preload` imports what every step loads (transformers' model base, auto
classes, tokenizers and generation, the memory tracker, every option module), and the tiny
model's two model classes and peft are named here (measured 11-29: 4 DeepSpeed runs of 2 ranks,
18.5 -> 10.9 s). The order counts: with :mod:`memlab.estimate.preload` before the model classes,
the same modules made those 4 runs ~1.3 s slower (measured three times each; not explained)."""

_configured: list[bool] = []


class _Fd:
    """A file descriptor of the run's process, handed to the rank (multiprocessing passes it
    through the fork server's socket when the rank's arguments are pickled)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return (_Received, (DupFd(self.fd),))


class _Received:
    def __init__(self, dup: Any):
        self.fd = dup.detach()


def _redirect(target: _Received | str, fd: int) -> None:
    if isinstance(target, str):
        new = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    else:
        new = target.fd
    os.dup2(new, fd)
    os.close(new)


ORPHAN_GRACE_S = 10.0
"""How long a rank whose run ended has to record ``interrupted`` before it kills itself (a rank
stuck in a collective does not run Python's signal handlers)."""


def _stop_with(pid: int, kill_after_s: float | None = ORPHAN_GRACE_S) -> None:
    """SIGTERM to this process when process ``pid`` (the run's) ends, or at once if it has;
    SIGKILL ``kill_after_s`` later if it is still there (None: never)."""
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = -1
    except (AttributeError, OSError):  # no pidfd (not Linux, or an old kernel): ask every second
        fd = None

    def wait() -> None:
        if fd is not None and fd >= 0:
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            poll.poll()
        elif fd is None:
            while _alive(pid):
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        if kill_after_s is not None:
            time.sleep(kill_after_s)
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="memlab-run-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _child(module: str, argv: list[str], env: dict[str, str], out: _Received | str,
           err: _Received | str, parent_pid: int, keep: list[_Received],
           orphan_kill_s: float | None) -> None:
    """The child's process: becomes ``python -m <module> <argv...>`` (the module docstring);
    ``keep``: descriptors it holds until it ends."""
    import atexit
    import runpy

    os.setsid()
    _stop_with(parent_pid, orphan_kill_s)
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(out, 1)
    _redirect(err, 2)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONUNBUFFERED"):  # as ``python -u``: each write reaches the pipe at once
        import io

        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      encoding=sys.stdout.encoding, errors=sys.stdout.errors)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      encoding=sys.stderr.encoding, errors="backslashreplace")
    if env.get("OMP_NUM_THREADS", "").isdigit():  # the server read its own when torch loaded
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [module, *argv]
    # run afresh as __main__ (what it imports stays loaded); a package runs its __main__
    loaded = sys.modules.get(module)
    sys.modules.pop(module if getattr(loaded, "__path__", None) is None
                    else f"{module}.__main__", None)
    code: Any = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.exit(code)


class _RankPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen (Python 3.10-3.13's ``_launch``), less the parent's
    ``__main__`` in the preparation data (the module docstring)."""

    def _launch(self, process_obj: Any) -> None:
        import io
        from multiprocessing import reduction, spawn, util
        from multiprocessing.context import set_spawning_popen
        from multiprocessing.forkserver import connect_to_new_process, read_signed

        prep = {k: v for k, v in spawn.get_preparation_data(process_obj._name).items()
                if k not in ("init_main_from_name", "init_main_from_path")}
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = read_signed(self.sentinel)


class _RankProcess(ForkServerProcess):
    """A forkserver process started through :class:`_RankPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _RankPopen(process_obj)


_server_env: dict[str, str] = {}
"""The environment the fork server started with (what its imports read)."""

IMPORT_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "TORCH",
              "PYTORCH_", "ATEN_", "ONEDNN_", "DNNL_", "MKL", "KMP_", "XDG_", "HOME",
              "PYTHONHASHSEED", "PYTHONPATH", "PYTHONWARNINGS")
"""Environment variables (by prefix) that what the server imports may read as it loads (cache
locations, offline modes, torch's CPU kernels, the hash seed): a process whose environment
differs from the server's in one of them is not forked from it (:func:`serves`)."""


SOCKET_DIR_MAX = 60
"""The longest temp dir multiprocessing's fork server may make its own dir under: it listens on
a Unix socket at ``<temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX`` (32 more bytes), and a socket's
path is at most 107 bytes (``sun_path``)."""


def socket_dir() -> str:
    """multiprocessing's temp dir for this process (where the fork server's socket goes), made
    under /tmp where TMPDIR is too long for a socket's path (:data:`SOCKET_DIR_MAX`: a test's
    ``tmp_path``, a deep scratch dir), which would stop the server from starting ("AF_UNIX path
    too long": no rank, no forked sweep job). multiprocessing removes it at exit, as its own.
    (Made once a process: where multiprocessing made it earlier, that one is kept.)"""
    import tempfile
    from multiprocessing import util

    if len(tempfile.gettempdir()) <= SOCKET_DIR_MAX:
        return util.get_temp_dir()
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        return util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def _context(preload: bool):
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    if not _configured:  # (the server takes its preload list once, when it starts)
        socket_dir()  # (before the server starts: its socket goes there)
        ctx.set_forkserver_preload(list(PRELOAD) if preload else [])
        _configured.append(preload)
        _server_env.update(os.environ)
    return ctx


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV)}


def serves(env: dict[str, str]) -> bool:
    """Whether a process with environment ``env`` may be a fork of the preloading server: it
    imports ahead (a machine without CUDA: :func:`cuda_present`), and ``env`` agrees with the
    server's on :data:`IMPORT_ENV` (the server's is this process's own until it has started)."""
    if (_configured and not _configured[0]) or cuda_present():
        return False
    return _import_env(env) == _import_env(_server_env if _configured else dict(os.environ))


def fork(module: str, argv: Sequence[str], env: dict[str, str], out: int | str,
         err: int | str, *, preload: bool, keep: Sequence[int] = (),
         orphan_kill_s: float | None = ORPHAN_GRACE_S, name: str | None = None) -> Any:
    """A started process that is what ``python -m <module> <argv...>`` would be, with
    environment ``env`` (the whole of it), forked from the server (the module docstring).
    ``out`` / ``err``: a descriptor of this process (passed to the child) or a file path;
    ``keep``: descriptors it holds while it lives; ``orphan_kill_s``: seconds from the SIGTERM
    it gets when this process ends to a SIGKILL (None: none). Returns the
    ``multiprocessing`` process (``pid``, ``exitcode``, ``join``)."""
    _context(preload)  # the fork server and what it imports ahead, set once
    p = _RankProcess(target=_child, name=name,
                     args=(module, list(argv), env, _Fd(out) if isinstance(out, int) else out,
                           _Fd(err) if isinstance(err, int) else err, os.getpid(),
                           [_Fd(fd) for fd in keep], orphan_kill_s))
    sys.stdout.flush()
    sys.stderr.flush()
    p.start()
    return p


class Forked:
    """A process of :func:`fork` seen as a ``subprocess.Popen`` (``pid``, ``poll``,
    ``returncode``, ``wait``, ``send_signal``): the sweep launcher's jobs."""

    def __init__(self, process: Any):
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def cuda_present() -> bool:
    """A CUDA device on this machine, read without importing torch (``/dev/nvidia<N>``): where
    one is, nothing is forked from a server that imported ahead."""
    from pathlib import Path

    return any(Path("/dev").glob("nvidia[0-9]*"))


@dataclass
class Started:
    """The ranks' processes (rank r at index r)."""

    procs: list[Any]
    stopped: set[int] = field(default_factory=set)
    """The ranks this process stopped (signalled while they still ran)."""

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self.procs)}

    def codes(self) -> list[int | None]:
        """Each rank's exit code (a negative number: killed by that signal), None: running."""
        return [p.exitcode for p in self.procs]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> list[int | None]:
        """``sig`` to every rank still running, SIGKILL to those left after ``timeout`` s;
        every exit code."""
        for r, p in enumerate(self.procs):
            if p.exitcode is None:
                self.stopped.add(r)
                _kill(p.pid, sig)
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(p.exitcode is None for p in self.procs):
            time.sleep(0.05)
        for p in self.procs:
            if p.exitcode is None:
                _kill(p.pid, signal.SIGKILL)
                p.join(5)
        return self.codes()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start(worker: str, run_dir: str, envs: dict[int, dict[str, str]],
          logs: dict[int, tuple[str, str] | None], preload: bool,
          keep: Sequence[int] = ()) -> Started:
    """One process per rank in ``envs`` (each the run's environment plus that rank's variables)
    running ``python -m <worker> <run_dir>``; ``logs[r]``: (stdout, stderr) files of rank r,
    None for the run's own; ``keep``: this process's descriptors every rank holds while it
    lives. ``preload``: import :data:`PRELOAD` in the server first (CPU only)."""
    procs = []
    try:
        for r, env in envs.items():
            files = logs.get(r)
            out, err = files if files else (1, 2)
            procs.append(fork(worker, [run_dir], {**os.environ, **env}, out, err,
                              preload=preload, keep=keep, name=f"rank{r}"))
    except BaseException:
        Started(procs).stop(signal.SIGKILL, 0)
        raise
    return Started(procs)
