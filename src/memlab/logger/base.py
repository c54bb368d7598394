"""What a logger option provides: ``start(info, config) -> LoggerRun`` on rank 0 (the option is
configuration only; the run it starts holds the connection)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from memlab import registry
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


@dataclass(frozen=True)
class RunInfo:
    """What a logger knows of the job it records: where it runs and what was chosen. A job
    that ended before it trained (an invalid configuration) has one too, so its logger still
    records it."""

    run_dir: Path
    choices: dict[str, str] = field(default_factory=dict)
    """Hydra's group choices of the job."""
    sweep_dir: Path | None = None
    """The sweep's directory (a multirun job), else None."""
    rank: int = 0

    @classmethod
    def of(cls, ctx: BuildContext, sweep_dir: str | Path | None) -> RunInfo:
        """The info of a validated run."""
        return cls(Path(ctx.run_dir), dict(ctx.choices), Path(sweep_dir) if sweep_dir else None,
                   ctx.rank)


class LoggerRun(Protocol):
    """One started logging run: per-step metrics, then the final summary."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Numbers by name; ``eval/samples`` (when present) is a list of ``{"step", "prompt",
        "completion"}`` rows (a table)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the run is and where its settings came from (summary.json's ``logger``)."""
        ...

    def finish(self, summary: dict[str, Any]) -> None: ...


class Logger(Option, Protocol):
    """A ``logger=`` option."""

    def start(self, info: RunInfo, config: dict[str, Any]) -> LoggerRun:
        """Start logging the job (rank 0); ``config`` is the run's resolved config."""
        ...


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
