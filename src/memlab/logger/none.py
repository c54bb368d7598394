"""`logger=none`: only the local summary.json (and the console table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlab.logger.base import NullRun
from memlab.registry import register


@register("logger", "none")
@dataclass(kw_only=True)
class NoLogger:
    """No knobs."""

    def validate(self, ctx) -> list[str]:
        return []

    def start(self, info, config: dict[str, Any]) -> NullRun:
        return NullRun()
