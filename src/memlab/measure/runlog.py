"""A run's log: what memlab says during a run, on the console and in ``<run dir>/memlab.log``.

memlab speaks through the ``memlab`` logger (:func:`say`, :func:`warn`, :func:`file_only`).
Hydra's job logging (``conf/hydra/job_logging/memlab.yaml``) gives the root logger two handlers:

- :class:`Console`: the message as it is, INFO on stdout, warnings and errors on stderr, written
  above a live progress bar (tqdm's ``write``), so a bar and a log line never share a line;
- a file handler for ``<run dir>/<job name>.log`` (``memlab.log``): every record, with its time.

The console leaves out what would only repeat the bar or drown memlab's own lines
(:func:`on_console`): the per-step lines (:func:`file_only`; the bar shows the same numbers) and,
while a run is in :func:`quiet_libraries`, other libraries' warnings (Python warnings,
transformers, datasets, DeepSpeed...), counted, and named in one line at the end ("3 warnings
from other libraries: see .../memlab.log"). Errors of any library stay on the console, and so do
memlab's own warnings. Without a log file (a user's own ``hydra/job_logging``) nothing is hidden.

A sweep job's console is copied into its memlab.log by the launcher
(:mod:`hydra_plugins.memlab_launcher.joblog`); the job's own file handler then writes only what
the console leaves out (:class:`NotOnConsole`), so the file holds each line once.

Where Hydra configured nothing (a rank process, a test calling :func:`memlab.run.run`), a
fallback console on the ``memlab`` logger says memlab's records all the same.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("memlab")
OWN = ("memlab", "hydra", "hydra_plugins")
"""Loggers whose records are memlab's own (Hydra's included): never hidden from the console."""
LIBRARY_LOGGERS = ("transformers", "datasets", "huggingface_hub", "accelerate", "peft",
                   "DeepSpeed", "torch", "bitsandbytes", "vllm")
"""Libraries whose loggers print on their own handlers: routed into the log in a run."""


def _own(record: logging.LogRecord) -> bool:
    if record.name == "py.warnings":  # a warning raised by memlab's own code
        text = record.getMessage()  # "<file>:<line>: <category>: <message>"
        return str(Path(__file__).parents[1]) in text.split(":", 1)[0]
    return any(record.name == o or record.name.startswith(o + ".") for o in OWN)


class _State:
    quiet = False  # inside quiet_libraries: other libraries' warnings leave the console
    hidden = 0     # how many of them did


def on_console(record: logging.LogRecord) -> bool:
    """Whether ``record`` is shown on the console (every other record goes to the file only)."""
    if getattr(record, "console", True) is False:
        return False
    if _own(record) or record.levelno >= logging.ERROR:
        return True
    return not _State.quiet


class NotOnConsole(logging.Filter):
    """The records :func:`on_console` leaves out (a sweep job's file handler: the launcher
    copies the console into the same file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not on_console(record)


class Console(logging.Handler):
    """memlab's console: the bare message (INFO on stdout, WARNING and above on stderr; all on
    stdout with ``split=False``, as Hydra's own lines), written above any live tqdm bar. The
    stream is the one current at each record (a captured or replaced ``sys.stdout`` gets it; a
    closed one is never written)."""

    def __init__(self, level: int | str = logging.NOTSET, split: bool = True):
        super().__init__(level)
        self.split = split
        self.addFilter(on_console)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            warning = self.split and record.levelno >= logging.WARNING
            stream = sys.stderr if warning else sys.stdout
            bars = sys.modules.get("tqdm")
            if bars is not None and getattr(bars.tqdm, "_instances", None):
                bars.tqdm.write(text, file=stream)
            else:
                stream.write(text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a handler never raises
            self.handleError(record)


class FileFormat(logging.Formatter):
    """The log file's lines: ``[time] message``; another library's record says whose it is
    and its level (``[time] [transformers.modeling_utils] WARNING: ...``)."""

    def __init__(self) -> None:
        super().__init__("[%(asctime)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if _own(record):
            return text
        stamp, _, message = text.partition("] ")
        return f"{stamp}] [{record.name}] {record.levelname}: {message}"


class _Fallback(Console):
    """The console of a process Hydra configured no console in."""

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger().handlers
        if not any(isinstance(h, Console) for h in root):
            super().emit(record)


if not any(isinstance(h, _Fallback) for h in log.handlers):
    log.addHandler(_Fallback())
log.setLevel(logging.INFO)


def say(message: str) -> None:
    """A line on the console and in the log."""
    log.info(message)


def warn(message: str) -> None:
    """A warning on the console (stderr) and in the log, as ``[memlab] warning: ...``."""
    log.warning(f"[memlab] warning: {message}")


def file_only(message: str) -> None:
    """A line in the log that the console does not show (what a progress bar shows already)."""
    log.info(message, extra={"console": False})


def file_plan() -> dict[str, Any] | None:
    """This process's log file, for its ranks (:func:`into_file`): its path, and whether its
    handler writes only what the console leaves out (a sweep job's console is copied into the
    same file by the launcher: :class:`NotOnConsole`). None: no log file."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            return {"path": h.baseFilename,
                    "off_console": any(isinstance(f, NotOnConsole) for f in h.filters)}
    return None


def into_file(plan: dict[str, Any] | None) -> None:
    """Rank 0 of a multi-process run writes its log into the run's log file too (``plan``: the
    run's :func:`file_plan`), appending beside the run's process, which logs its own lines
    there: the data counts, the interval and eval lines are the ranks'. As the run's handler
    does: only what the console leaves out when a sweep's launcher copies the console into the
    same file. Nothing when the run has no log file, or this process has one already."""
    root = logging.getLogger()
    if not plan or not Path(plan["path"]).is_file() or any(
            isinstance(h, logging.FileHandler) for h in root.handlers):
        return
    handler = logging.FileHandler(plan["path"], mode="a", encoding="utf-8")
    handler.setFormatter(FileFormat())
    if plan.get("off_console"):
        handler.addFilter(NotOnConsole())
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def log_path() -> Path | None:
    """The file this process logs into (the root logger's file handler), if any."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            return Path(h.baseFilename)
    return None


class _Count(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING and not on_console(record):
            _State.hidden += 1


class _ToRoot(logging.Filter):
    """On a library's logger: its records go to the root's handlers (the log), not to the
    handlers the library gave it (DeepSpeed adds its own on import, mid-run). Each record once:
    a library whose logger also propagates to the root (``enable_propagation()``), or that has
    two console handlers, would otherwise be logged and counted twice (:class:`_Once`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "memlab_routed", False):
            return False
        for h in logging.getLogger().handlers:
            if record.levelno >= h.level and self not in h.filters:
                h.handle(record)
        record.memlab_routed = True
        return False


class _Once(logging.Filter):
    """On the root's handlers in a run: a record :class:`_ToRoot` gave them already is not
    handled again when it propagates up to them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "memlab_routed", False)


def _prints(handler: logging.Handler) -> bool:
    """Whether ``handler`` writes to the console (a library's own; not a file, not a test's)."""
    return type(handler) is logging.StreamHandler


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Other libraries' warnings and progress bars off the console for the ``with`` block (a
    run): their log records and Python warnings go to the log file, counted; transformers'
    bars (writing shards) are off. At the end, one line says how many warnings the console did
    not show, and where they are. Nothing changes where no log file is configured."""
    path = log_path()
    if path is None:
        yield
        return
    _own_handlers()
    root = logging.getLogger()
    count, redirect = _Count(), _ToRoot()
    # the filter on each library's logger (its own records, and the handler DeepSpeed adds on
    # import) and on the handlers it has (what its child loggers pass up to them)
    routed: list[logging.Filterer] = [logging.getLogger(n) for n in LIBRARY_LOGGERS]
    routed += [h for n in LIBRARY_LOGGERS for h in logging.getLogger(n).handlers
               if _prints(h) and h not in root.handlers]
    for each in routed:
        each.addFilter(redirect)
    bars = _transformers_bars(False)
    root.addHandler(count)
    once = _Once()
    for h in root.handlers:
        h.addFilter(once)
    logging.captureWarnings(True)
    _State.quiet, _State.hidden = True, 0
    try:
        yield
    finally:
        _State.quiet = False
        logging.captureWarnings(False)
        for h in root.handlers:
            h.removeFilter(once)
        root.removeHandler(count)
        for each in routed:
            each.removeFilter(redirect)
        _transformers_bars(bars)
        if _State.hidden:
            n = _State.hidden
            say(f"{n} warning{'s' if n != 1 else ''} from other libraries: see {path}")


def _own_handlers() -> None:
    """transformers' and datasets' loggers print on handlers they add when first used: have
    them add those now (each library's child loggers pass their records up to it, where
    :class:`_ToRoot` catches them)."""
    for name in ("transformers", "datasets"):
        module = sys.modules.get(f"{name}.utils.logging")
        if module is None:
            with contextlib.suppress(ImportError):
                module = __import__(f"{name}.utils.logging", fromlist=["get_logger"])
        if module is not None:
            module.get_logger(name)


def _transformers_bars(on: bool | None) -> bool | None:
    """Turn transformers' progress bars on or off; returns whether they were on (None: not
    installed)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    was = hf_logging.is_progress_bar_enabled()
    if on is True:
        hf_logging.enable_progress_bar()
    elif on is False:
        hf_logging.disable_progress_bar()
    return was


def job_logging_config(handlers: Any) -> bool:
    """Whether Hydra's ``job_logging.handlers`` has memlab's console (:class:`Console`)."""
    console = handlers.get("console") if isinstance(handlers, dict) else None
    return isinstance(console, dict) and console.get("class") == f"{__name__}.Console"


@contextlib.contextmanager
def datasets_bars(on: bool) -> Iterator[None]:
    """Hugging Face datasets' progress bars on or off inside the ``with`` block (one bar a
    phase: a data load shows the training rows' preparation, not the file's reading, the row
    conversion or the held-out rows' own bars)."""
    try:
        from datasets import utils as hf_bars
    except ImportError:
        yield
        return
    was = not hf_bars.are_progress_bars_disabled()
    (hf_bars.enable_progress_bars if on else hf_bars.disable_progress_bars)()
    try:
        yield
    finally:
        (hf_bars.enable_progress_bars if was else hf_bars.disable_progress_bars)()


def data_line(stats: dict[str, Any], what: str = "data") -> str:
    """One line of a prepared dataset's counts (the log's data line)."""
    shown = ("examples", "rows", "tokens_in", "tokens_dropped", "examples_dropped",
             "trainable_tokens", "hollow_rows", "fill_ratio")
    return f"{what}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in stats.items() if k in shown and v is not None)
