"""A sweep job's console, kept in its own log: everything the job's process (and what it starts)
prints goes to ``<job dir>/memlab.log``, and to the sweep's console when jobs run one at a time,
so a job that failed can be read after the fact. The launcher copies it (not the job), so the
log holds the job's last words even when the job is killed. The console shows progress bars live;
the file keeps the last state of each bar's line (:class:`Lines`: no runs of ``\\r`` updates).

The job's Hydra log records reach the file through its console (:func:`console_only`): the job's
own file handler writes only the records its console does not show (memlab's job logging: the
per-step lines, other libraries' warnings; :mod:`memlab.measure.runlog`), appending, so the file
holds each record once; with another job logging, that file handler is dropped.
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
    """The job's Hydra file handler, when it writes the file :class:`JobLog` writes: with
    memlab's console, kept for what that console leaves out (appending; its filter
    :class:`memlab.measure.runlog.NotOnConsole`); with another console, dropped (a user's own
    logging config, writing elsewhere, is left as it is)."""
    from memlab.measure import runlog

    logging = OmegaConf.select(config, "hydra.job_logging")
    handlers = OmegaConf.select(config, "hydra.job_logging.handlers")
    root = OmegaConf.select(config, "hydra.job_logging.root.handlers")
    if not isinstance(handlers, DictConfig) or "file" not in handlers or root is None:
        return
    spec = OmegaConf.to_container(handlers, resolve=False)
    if not isinstance(spec, dict) or (spec.get("file") or {}).get("filename") != HYDRA_LOG:
        return
    with read_write(config.hydra), open_dict(config.hydra):
        if runlog.job_logging_config(spec):
            filters = OmegaConf.select(config, "hydra.job_logging.filters") or {}
            logging.filters = {**filters, "not_on_console": {
                "()": f"{runlog.__name__}.{runlog.NotOnConsole.__name__}"}}
            logging.handlers.file.filters = ["not_on_console"]
            logging.handlers.file.mode = "a"  # the launcher's copy writes the same file
            return
        logging.root.handlers = [h for h in root if h != "file"]
        del logging.handlers["file"]


class Lines:
    """A byte stream as the lines a terminal ends up showing: of each line, the text after its
    last ``\\r`` that is not blank (a progress bar's last state); the rest of the line is kept
    until it ends (:meth:`feed`) or the stream does (:meth:`end`)."""

    def __init__(self) -> None:
        self._line = b""

    @staticmethod
    def _last(line: bytes) -> bytes:
        return next((part for part in reversed(line.split(b"\r")) if part.strip()), b"")

    def feed(self, chunk: bytes) -> bytes:
        """The lines ``chunk`` ends (with their newlines)."""
        *done, self._line = (self._line + chunk).split(b"\n")
        if b"\r" in self._line:  # only the last state and the one being written are kept
            *before, now = self._line.split(b"\r")
            self._line = self._last(b"\r".join(before)) + b"\r" + now
        return b"".join(self._last(line).rstrip(b" ") + b"\n" for line in done)

    def end(self) -> bytes:
        """The unended line's last state (with a newline), when there is one."""
        last, self._line = self._last(self._line).rstrip(b" "), b""
        return last + b"\n" if last else b""


class JobLog:
    """Copies a job's output pipe into ``path`` (a link there is replaced, never followed) and,
    with ``echo``, to this process's stdout, on a thread, until the pipe closes."""

    def __init__(self, pipe: IO[bytes], path: Path, echo: bool):
        self.path, self.echo = path, echo
        path.parent.mkdir(parents=True, exist_ok=True)
        unlink_link(path)
        # appending: the job's own file handler adds what its console leaves out
        self._file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
                             | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self._lines = Lines()
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
                self._write(self._lines.feed(chunk))
                if self.echo:
                    self._show(chunk)
        finally:
            self._write(self._lines.end())
            os.close(self._file)
            self._pipe.close()

    def _write(self, data: bytes) -> None:
        try:
            if data:
                os.write(self._file, data)
        except OSError:
            pass  # a full disk loses log lines, never the job

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
