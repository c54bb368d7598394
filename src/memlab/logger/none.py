"""`logger=none`: only the local summary.json (and the console table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.registry import register


@register("logger", "none")
@dataclass(kw_only=True)
class NoLogger:
    """No knobs."""

    def validate(self, ctx) -> list[str]:
        return []

    def start(self, ctx, config: dict[str, Any]) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass
