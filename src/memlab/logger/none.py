"""`logger=none`: only the local summary.json (and the console table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memlab.logger.base import NullRun, RunInfo, register
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("none")
@dataclass(kw_only=True)
class NoLogger(Option):
    """No knobs."""

    def validate(self, ctx: BuildContext) -> list[str]:
        return []

    def start(self, info: RunInfo, config: dict[str, Any]) -> NullRun:
        return NullRun()
