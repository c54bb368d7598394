"""Run and sweep directories: one memlab job at a time in each, a new one for every time-stamped
run, and a record even when the directory asked for cannot be written.

A Hydra run or sweep claims its directory before Hydra writes anything there (:class:`RunDirs`,
the Hydra callback ``conf/config.yaml`` installs; ``memlab fit`` claims its ``--out`` the same
way, :func:`claim`):

- **a lock**: ``flock`` on ``<dir>/.memlab.lock``, held by the launching process until it ends
  (its ranks, a sweep's job processes and fit's measuring runs work under it). A second memlab
  job into a directory in use is refused before it writes anything (exit 2, naming the process
  that holds it), so two runs never overwrite each other's summary, checkpoints or
  ``.hydra/`` files. The lock file says who holds it (pid, host, start, command line).
- **a new directory per time-stamped run**: a directory whose spec holds ``${now:...}`` (the
  default ``outputs/<date>/<time>`` and ``multirun/<date>/<time>``) is taken with an exclusive
  ``mkdir``; when a run started in the same second has it, the next free name (``<time>_1``,
  ``_2``...) is this run's. The spec keeps its stamp (``outputs/${now:...}_1``), so the outputs
  tree ``train.resume_from=latest`` searches is the same.
- **a fallback directory**: a directory that cannot be created or written (read-only, a file in
  its path) moves to a directory named after it in the fallback places of summaries
  (:func:`memlab.measure.summary.fallback_paths`: ``$MEMLAB_FALLBACK_DIR``, else
  ``<tmp>/memlab-unsaved/``); the run goes on there, says so on stderr, and its summary's
  ``write_error`` names both (:func:`moved_note`).
- **no links followed**: a link planted where Hydra writes a job's files (``.hydra/*.yaml``,
  ``<job name>.log``, ``multirun.yaml``) is removed first (Hydra would write through it).

This module is light (no torch): Hydra instantiates the callback at start-up.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from memlab.measure.summary import fallback_paths, unlink_link

LOCK = ".memlab.lock"
"""The lock file in every claimed directory (its content: who holds it, where it moved from)."""

MAX_SUFFIX = 1000
"""Names tried for a time-stamped directory (``<time>``, ``<time>_1``, ...)."""

STAMP = "${now:"
"""A directory spec that holds this is time-stamped: every run gets a new directory."""

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
"""``flock`` errors of file systems without locks (some network mounts): the run goes on
unlocked, with a warning."""


class DirInUse(RuntimeError):
    """Another memlab process holds the directory's lock."""

    def __init__(self, path: Path, holder: dict[str, Any]):
        self.path, self.holder = path, holder
        who = holder_words(holder)
        cmd = holder.get("command")
        super().__init__(f"in use by another memlab job ({who}"
                         + (f": {cmd}" if cmd else "") + ")")


@dataclass
class Claim:
    """A directory this process holds."""

    path: Path
    """The directory the job uses."""
    wanted: Path
    """The directory asked for (``path`` unless it moved)."""
    why: str | None = None
    """Why it moved to a fallback directory (None: it did not)."""
    fd: int | None = None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the file releases the lock
            self.fd = None


_HELD: dict[str, Claim] = {}
"""The claims of this process, by kind (``run``, ``sweep``, ``job``, ``fit``): a new claim of a kind
releases the previous one (one Hydra run at a time per process; a test may run many)."""


def claim(path: Path | str, *, fresh: bool, kind: str = "run") -> Claim:
    """Claim directory ``path`` for this process (module docstring): create it, lock it
    (:class:`DirInUse` when another process holds it; a ``fresh`` directory takes the next free
    name instead), or move to a fallback directory when it cannot be written. Raises the
    OSError only when no fallback can be written either."""
    release(kind)
    wanted = Path(os.path.abspath(path))
    try:
        got = _claim_at(wanted, fresh)
    except DirInUse:
        raise
    except OSError as first:
        got = _fallback(wanted, first)
    _describe(got)
    _HELD[kind] = got
    return got


def _fallback(wanted: Path, error: OSError) -> Claim:
    """A new directory in the first fallback place that works, for ``wanted``."""
    for alt in fallback_paths(wanted, create=True):
        try:
            got = _claim_at(alt, fresh=True)
        except OSError:
            continue
        got.wanted, got.why = wanted, f"{type(error).__name__}: {error}"
        return got
    raise error


def held_descriptors() -> list[int]:
    """The lock descriptors of this process's claims: a run's ranks hold them too, so a
    directory stays locked until the last process working in it is gone."""
    return [c.fd for c in _HELD.values() if c.fd is not None]


def release(kind: str) -> None:
    """Release this process's claim of ``kind`` (if any)."""
    old = _HELD.pop(kind, None)
    if old is not None:
        old.release()


def _claim_at(path: Path, fresh: bool) -> Claim:
    names = [path] + ([path.with_name(f"{path.name}_{i}") for i in range(1, MAX_SUFFIX)]
                      if fresh else [])
    for p in names:
        if fresh:
            try:
                p.mkdir(parents=True)  # exclusive: a run of the same second has it
            except FileExistsError:
                continue
        else:
            p.mkdir(parents=True, exist_ok=True)
        try:
            return Claim(p, p, fd=_lock(p))
        except DirInUse:
            if fresh:
                continue
            raise
    raise FileExistsError(errno.EEXIST, f"no free name for a new directory beside {path}")


def _lock(directory: Path) -> int | None:
    """An exclusive lock on ``directory``'s lock file; the open descriptor (None: the file
    system has no locks). Raises :class:`DirInUse` when another process holds it."""
    import fcntl

    path = directory / LOCK
    unlink_link(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirInUse(directory, _holder(path)) from None
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            os.close(fd)
            raise
        print(f"[memlab] {directory}: the file system has no locks ({e.strerror}); nothing "
              "stops another run from using this directory at the same time", file=sys.stderr,
              flush=True)
    return fd


def in_use(directory: Path | str) -> dict[str, Any] | None:
    """Who holds ``directory``'s lock (its lock file's content; ``{}`` when it says nothing) when
    another process holds it: a live run, sweep job or fit works there. None when nobody does,
    when this process holds it itself, or when there is no lock file (or no locks)."""
    import fcntl

    directory = Path(directory)
    if any(c.path.resolve() == directory.resolve() for c in _HELD.values()):
        return None
    try:
        fd = os.open(directory / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(directory / LOCK)
    except OSError:
        return None
    finally:
        os.close(fd)  # (releases the shared lock taken, if it was)
    return None


def holder_words(holder: dict[str, Any]) -> str:
    """``pid 12, since 2026-01-01 10:00:00`` (what a lock file says of its holder)."""
    return ", ".join(f"{k} {holder[k]}" for k in ("pid", "host", "since") if holder.get(k)) or (
        "holder unknown")


def _describe(c: Claim) -> None:
    """Who holds the claim, and where it moved from, into its lock file."""
    info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "command": " ".join(["memlab", *sys.argv[1:]])}
    if c.why:
        info.update(wanted=str(c.wanted), why=c.why)
    data = json.dumps(info).encode()
    try:
        if c.fd is not None:
            os.ftruncate(c.fd, 0)
            os.pwrite(c.fd, data, 0)
    except OSError:
        pass  # the lock holds all the same


def _holder(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def moved_note(*dirs: Path | str | None) -> str | None:
    """Why the first of ``dirs`` that moved to a fallback directory did (read from its lock
    file: a sweep job reads its sweep dir's), as a summary's ``write_error``; None when none
    moved."""
    for d in dirs:
        if not d:
            continue
        info = _holder(Path(d) / LOCK)
        if info.get("wanted"):
            return (f"could not use {info['wanted']} ({info.get('why')}); this run's directory "
                    f"is {d} instead")
    return None


def remove_links(directory: Path, names: list[str]) -> None:
    """Remove links planted at ``names`` under ``directory`` (files Hydra is about to write)."""
    for name in names:
        try:
            unlink_link(directory / name)
        except OSError:
            pass


# ------------------------------------------------------------------------------ Hydra's side
def _torchrun_rank() -> int:
    """This process's rank under an external launcher (torchrun), else 0: only rank 0 claims
    the run dir the ranks share."""
    if "MEMLAB_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    return int(os.environ.get("RANK", "0"))


def _spec(node: Any) -> str:
    """A ``hydra.run`` / ``hydra.sweep`` node's ``dir`` as written (unresolved)."""
    from omegaconf import OmegaConf

    spec = OmegaConf.to_container(node, resolve=False)
    return str((spec.get("dir") if isinstance(spec, dict) else None) or "")


def _quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value (interpolations in it still resolve)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _take(config: Any, node: str, kind: str) -> Claim:
    """Claim ``hydra.<node>.dir`` of ``config``; point the config at the directory claimed
    (refused: a message and exit 2)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, read_write

    HydraConfig.instance().set_config(config)
    spec = _spec(config.hydra[node])
    wanted = Path(os.path.abspath(str(OmegaConf.select(config, f"hydra.{node}.dir"))))
    try:
        got = claim(wanted, fresh=STAMP in spec, kind=kind)
    except DirInUse as e:
        print(f"memlab: hydra.{node}.dir={wanted} is {e}; this {kind} was not started (it "
              f"would overwrite that job's files). Wait for it to end, or give this {kind} "
              f"another hydra.{node}.dir", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except OSError as e:
        print(f"memlab: cannot create hydra.{node}.dir={wanted} ({type(e).__name__}: {e}), "
              "nor a fallback directory (set MEMLAB_FALLBACK_DIR to a writable one)",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if got.path != wanted:
        new = spec.rstrip("/") + got.path.name[len(wanted.name):] if STAMP in spec and not \
            got.why else str(got.path)
        with read_write(config.hydra[node]):
            config.hydra[node].dir = new
        if Path(os.path.abspath(str(OmegaConf.select(config, f"hydra.{node}.dir")))) != \
                got.path:  # the spec cannot be extended: the directory as it is
            with read_write(config.hydra[node]):
                config.hydra[node].dir = str(got.path)
        if got.why:
            print(f"[memlab] {moved_note(got.path)}", file=sys.stderr, flush=True)
    return got


class RunDirs(Callback):
    """The Hydra callback (``hydra.callbacks.memlab_dirs``) that claims each run's and sweep's
    directory before Hydra writes there (module docstring)."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        if _torchrun_rank() != 0:
            return
        got = _take(config, "run", "run")
        job = str(config.hydra.job.name)
        sub = str(config.hydra.output_subdir) if config.hydra.output_subdir else None
        remove_links(got.path, [f"{job}.log"] + ([f"{sub}/{n}" for n in (
            "config.yaml", "hydra.yaml", "overrides.yaml")] if sub else []))

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        release("run")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import open_dict, read_write

        before = _spec(config.hydra.sweep)
        got = _take(config, "sweep", "sweep")
        after = _spec(config.hydra.sweep)
        if after != before:  # every job's config is composed again: it gets the same dir
            with read_write(config.hydra.overrides), open_dict(config.hydra.overrides):
                config.hydra.overrides.hydra.append(f"hydra.sweep.dir={_quoted(after)}")
        remove_links(got.path, ["multirun.yaml"])

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        release("sweep")

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        """A sweep job holds its own dir too (a single run's was claimed at its start), so
        ``memlab report`` and ``train.resume_from=latest`` tell a running job from a dead one."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.get().mode != RunMode.MULTIRUN or _torchrun_rank() != 0:
            return
        release("job")
        out = Path(os.path.abspath(HydraConfig.get().runtime.output_dir))
        try:
            got = _claim_at(out, fresh=False)
        except DirInUse as e:
            print(f"memlab: {out} is {e}; this job was not started", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except OSError:
            return  # an unwritable job dir: the job's record goes to its fallback path
        _describe(got)
        _HELD["job"] = got

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        release("job")
