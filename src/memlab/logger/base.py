"""What a logger option provides: ``start(ctx, config) -> LoggerRun`` on rank 0 (the option is
configuration only; the run it starts holds the connection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from memlab import registry
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


class LoggerRun(Protocol):
    """One started logging run: per-step metrics, then the final summary."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...


class Logger(Option, Protocol):
    """A ``logger=`` option."""

    def start(self, ctx: BuildContext, config: dict[str, Any]) -> LoggerRun:
        """Start logging the run (rank 0); ``config`` is the run's resolved config."""
        ...


LoggerClass = TypeVar("LoggerClass", bound=Logger)


def register(name: str) -> Callable[[type[LoggerClass]], type[LoggerClass]]:
    """Register a ``logger=`` option (mypy checks it against :class:`Logger`)."""
    return registry.register("logger", name)


class NullRun:
    """A run that records nothing (``logger=none``, and ranks other than 0)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        return None

    def finish(self, summary: dict[str, Any]) -> None:
        return None
