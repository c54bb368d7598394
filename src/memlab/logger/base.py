"""What a logger option provides: ``start(info, config) -> LoggerRun`` on rank 0 (the option is
configuration only; the run it starts holds the connection)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


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
    def of(cls, ctx, sweep_dir: str | Path | None) -> RunInfo:
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


class Logger(Protocol):
    """A ``logger=`` option."""

    def validate(self, ctx) -> list[str]: ...

    def start(self, info: RunInfo, config: dict[str, Any]) -> LoggerRun: ...


class NullRun:
    """A run that records nothing (``logger=none``, and ranks other than 0)."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {}

    def finish(self, summary: dict[str, Any]) -> None:
        return None
