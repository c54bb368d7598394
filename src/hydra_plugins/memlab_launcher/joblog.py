"""A sweep job's console, kept in its own log: everything the job's process (and what it starts)
prints goes to ``<job dir>/memlab.log``, and to the sweep's console when jobs run one at a time,
so a job that failed can be read after the fact. The launcher copies it (not the job), so the
log holds the job's last words even when the job is killed.

The job's Hydra log records reach the file through its console (:func:`console_only`): Hydra's
own file handler, which would write each of them into the same file a second time, is dropped.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import IO, Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from memlab.measure.summary import unlink_link

HYDRA_LOG = "${hydra.runtime.output_dir}/${hydra.job.name}.log"
"""The file Hydra's default job logging writes (``<job dir>/memlab.log``)."""


def console_only(config: DictConfig) -> None:
    """Drop the job's Hydra file handler when it writes the file :class:`JobLog` writes (a
    user's own logging config is left as it is)."""
    handlers = OmegaConf.select(config, "hydra.job_logging.handlers")
    root = OmegaConf.select(config, "hydra.job_logging.root.handlers")
    if not isinstance(handlers, DictConfig) or "file" not in handlers or root is None:
        return
    spec = OmegaConf.to_container(handlers.file, resolve=False)
    if not isinstance(spec, dict) or spec.get("filename") != HYDRA_LOG:
        return
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.job_logging.root.handlers = [h for h in root if h != "file"]
        del config.hydra.job_logging.handlers["file"]


class JobLog:
    """Copies a job's output pipe into ``path`` (a link there is replaced, never followed) and,
    with ``echo``, to this process's stdout, on a thread, until the pipe closes."""

    def __init__(self, pipe: IO[bytes], path: Path, echo: bool):
        self.path, self.echo = path, echo
        path.parent.mkdir(parents=True, exist_ok=True)
        unlink_link(path)
        self._file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
        self._pipe = pipe
        self._thread = threading.Thread(target=self._copy, name=f"log:{path}", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        fd = self._pipe.fileno()
        try:
            while True:
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                try:
                    os.write(self._file, chunk)
                except OSError:
                    pass  # a full disk loses log lines, never the job
                if self.echo:
                    self._show(chunk)
        finally:
            os.close(self._file)
            self._pipe.close()

    def _show(self, chunk: bytes) -> None:
        out: Any = getattr(sys.stdout, "buffer", None)
        try:
            if out is not None:
                out.write(chunk)
            else:
                sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        except (OSError, ValueError):  # the terminal is gone (SIGHUP): the file goes on
            self.echo = False

    def join(self, timeout: float = 10.0) -> None:
        """Wait until the job's output is copied (bounded: a process the job left behind may
        hold the pipe open; the copy then goes on in the background)."""
        self._thread.join(timeout)
