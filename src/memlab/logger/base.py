"""What a logger option provides: ``start(ctx, config) -> LoggerRun`` on rank 0 (the option is
configuration only; the run it starts holds the connection)."""

from __future__ import annotations

from typing import Any, Protocol


class LoggerRun(Protocol):
    """One started logging run: per-step metrics, then the final summary."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...


class Logger(Protocol):
    """A ``logger=`` option."""

    def validate(self, ctx) -> list[str]: ...

    def start(self, ctx, config: dict[str, Any]) -> LoggerRun: ...


class NullRun:
    """A run that records nothing (``logger=none``, and ranks other than 0)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        return None

    def finish(self, summary: dict[str, Any]) -> None:
        return None
