"""What dataset preparation did to the tokens (the ``data`` section of summary.json)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataStats:
    """Counts of a prepared dataset: examples, rows, tokens in, tokens dropped by truncation or
    packing overflow, examples dropped, packing fill and time, method-specific extras."""

    examples: int = 0
    rows: int = 0
    tokens_in: int = 0
    tokens_dropped: int = 0
    examples_dropped: int = 0
    fill_ratio: float | None = None
    packing_seconds: float | None = None
    trainable_tokens: int | None = None
    """Tokens the loss trains on (labels, or the tokens of non-empty completions); None where
    the method does not count them (online methods generate what they train on)."""
    hollow_rows: int | None = None
    """Examples that carry no training signal (SFT rows whose every trained turn or completion
    is empty, preference pairs whose chosen and rejected tokens are the same, KTO examples with
    an empty completion); None where the method does not count them."""
    hollow_what: str = field(default="", repr=False)
    """What a hollow example of this method is, in words (for messages; not recorded)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("extra", "hollow_what")}
        d.update(self.extra)
        return d
