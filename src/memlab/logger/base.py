"""What a logger option provides: ``start(info, config) -> LoggerRun`` on rank 0 (the option is
configuration only; the run it starts holds the connection). :class:`Logger`,
:class:`LoggerRun` and :class:`RunInfo` are in :mod:`memlab.protocols`, re-exported here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from memlab import registry
from memlab.protocols import Logger
from memlab.protocols import LoggerRun as LoggerRun
from memlab.protocols import RunInfo as RunInfo

LoggerClass = TypeVar("LoggerClass", bound=Logger)


def register(name: str) -> Callable[[type[LoggerClass]], type[LoggerClass]]:
    """Register a ``logger=`` option (mypy checks it against :class:`Logger`)."""
    return registry.register("logger", name)


def build_logger(node: Mapping[str, Any]) -> tuple[Logger | None, list[str]]:
    """The ``logger=`` option a config node describes, built and checked as a run's is
    (:func:`memlab.registry.build`; a job that ended before its logger started records it)."""
    obj, errors = registry.build("logger", node)
    # the logger group holds only the classes its typed register admitted: Loggers
    return cast("Logger | None", obj), errors


class NullRun:
    """A run that records nothing (``logger=none``, and ranks other than 0)."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {}

    def finish(self, summary: dict[str, Any]) -> None:
        return None
