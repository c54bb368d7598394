"""`generation=hf`: transformers' ``generate`` in the training process (today's path).

Placeholder so that the ``generation`` group exists on this branch; the lead's refactor supplies
the engine."""

from __future__ import annotations

from dataclasses import dataclass

from memlab.registry import register


@register("generation", "hf")
@dataclass(kw_only=True)
class Hf:
    """No knobs: sampling settings come from the method."""

    def validate(self, ctx) -> list[str]:
        return []
