"""``hydra/sweeper=progress``: Hydra's basic sweeper with a progress bar (``memlab estimate -m``).

A sweep of in-process jobs (the basic launcher: ``memlab estimate -m``) said nothing until its
first job ended: before launching, Hydra's basic sweeper composes every job's configuration to
check it (``validate_batch_is_legal``; about 0.2 s a job on 2 CPU cores, so minutes for a
7,169-job sweep), and the basic launcher then prints two lines a job. This sweeper does the
same work, in the same order (every configuration checked before the first job runs, jobs
numbered as Hydra numbers them), and says so on stderr with two tqdm bars from the start:

    [memlab] composing: 100%|##########| 7169/7169 [00:58<00:00, 123.4 config/s]
    [memlab] jobs:  12%|#2        | 860/7169 [05:10<38:00, 2.77 job/s, lowest peak 15.7 MiB (#3)]

each with its ETA; a job that returns a record with a ``peak_bytes`` (an estimate) updates the
lowest peak so far. The launcher's own lines per job are left out (the bar counts them); a
Python warning, and memlab's console (:mod:`memlab.measure.runlog`), are written above the
bars.
With the basic launcher the jobs launch one at a time, so the bar moves per job; another
launcher gets every job at once, as from the basic sweeper. On a terminal the bars redraw in
place; elsewhere (a pipe, a log) they write a line at most every 10 s, and always their start
and their end. Hydra imports this module at start-up: it stays light (tqdm is imported when a
sweep starts).
"""


import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from omegaconf import OmegaConf

NAME = "progress"
"""The option of ``hydra/sweeper`` (``hydra/sweeper=progress``)."""


@dataclass
class ProgressSweeperConf:
    _target_: str = "hydra_plugins.memlab_launcher.progress.ProgressSweeper"
    max_batch_size: int | None = None
    """As the basic sweeper's (jobs handed to a launcher other than the basic one at once)."""
    params: dict[str, str] | None = None
    """The sweep's parameters, as the basic sweeper's (``sweep=<name>`` sets them)."""


ConfigStore.instance().store(group="hydra/sweeper", name=NAME, node=ProgressSweeperConf,
                             provider="memlab")


class SweepProgress:
    """The two bars of a sweep of ``total`` jobs on ``stream`` (default: stderr): the
    configurations composed (:meth:`composed`), then the jobs ended (:meth:`ended`)."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        tty = self.stream.isatty() and os.environ.get("TERM") != "dumb"
        self._kw = {"total": total, "file": self.stream, "dynamic_ncols": tty,
                    "mininterval": 0.5 if tty else 10.0, "leave": True}
        self.bar = self._bar("[memlab] composing", "config")
        self.lowest: tuple[int, int] | None = None  # (peak bytes, job number)

    def _bar(self, desc: str, unit: str) -> Any:
        from tqdm import tqdm

        return tqdm(desc=desc, unit=unit, **self._kw)  # (drawn at once: 0/N)

    def composed(self) -> None:
        self.bar.update()

    def running(self) -> None:
        """Every configuration is composed: the jobs' bar starts."""
        self.bar.close()
        self.bar = self._bar("[memlab] jobs", "job")

    def ended(self, num: int, value: Any) -> None:
        """Job ``num`` ended and returned ``value``."""
        peak = value.get("peak_bytes") if isinstance(value, Mapping) else None
        if (isinstance(peak, int) and not isinstance(peak, bool) and value.get("status") == "ok"
                and (self.lowest is None or peak < self.lowest[0])):
            self.lowest = (peak, num)
            self.bar.set_postfix_str(f"lowest peak {peak / 2**20:.1f} MiB (#{num})",
                                     refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextmanager
def _under_bars() -> Iterator[None]:
    """While the bars count the jobs: the basic launcher's lines (``Launching 1 jobs
    locally``, ``#3 : ...``) left out, and a Python warning (a library's, in a job) written
    above the bars (tqdm's ``write``) instead of into the middle of one (``warnings.showwarning``
    is the hook the warnings module has for this; the one before is put back)."""
    from tqdm import tqdm

    def above(message, category, filename, lineno, file=None, line=None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line)
        tqdm.write(text, file=file if file is not None else sys.stderr, end="")

    logger = logging.getLogger(BasicLauncher.__module__)
    drop = _Drop()
    logger.addFilter(drop)
    shown = warnings.showwarning
    warnings.showwarning = above
    try:
        yield
    finally:
        warnings.showwarning = shown
        logger.removeFilter(drop)


class ProgressSweeper(BasicSweeper):
    """The basic sweeper (same parameters, the same jobs and numbers, every configuration
    checked first) with :class:`SweepProgress` on stderr."""

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        params = [*self._parse_config(), *arguments]
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params), self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        jobs = [list(job) for batch in self.overrides for job in batch]
        one_by_one = isinstance(self.launcher, BasicLauncher)
        groups = ([[job] for job in jobs] if one_by_one
                  else [list(batch) for batch in self.overrides])
        progress = SweepProgress(len(jobs))
        returns: list[Sequence[JobReturn]] = []
        try:
            for job in jobs:  # as the basic sweeper: a bad combination stops the sweep early
                self.validate_batch_is_legal([job])
                progress.composed()
            progress.running()
            with _under_bars():
                num = 0
                for group in groups:
                    results = self.launcher.launch(group, initial_job_idx=num)
                    for r in results:
                        progress.ended(num, r.return_value)  # (a job that raised raises here)
                        num += 1
                    returns.append(results)
        finally:
            progress.close()
        self.batch_index = len(self.overrides)
        return returns
