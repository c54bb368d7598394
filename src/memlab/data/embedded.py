"""`data=embedded`: conversations or preference pairs generated deterministically by memlab
(seeded; heavy-tailed lengths like real chat data: median a few hundred tokens, tail to
several thousand). Needs no network."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from memlab.data.base import register
from memlab.data.formats import RowOptions
from memlab.registry import PositiveInt, Seed

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("embedded")
@dataclass(kw_only=True)
class Embedded(RowOptions):
    """Size and shape of the generated set."""

    kind: Literal["auto", "chat", "text", "preference"] = "auto"
    """auto = what the method trains on (chat for SFT, preference pairs for DPO/Reward/KTO)."""
    n_examples: PositiveInt = 2000
    """Rows generated."""
    seed: Seed = 0
    """Seed of the generated rows (the same seed gives the same data)."""
    median_tokens: PositiveInt = 300
    """Median length of a generated row, in tokens (lengths are long-tailed, like chat data)."""
    max_tokens: PositiveInt = 6000
    """Longest generated row, in tokens."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = self.row_errors()
        if self.n_examples <= 0:
            errors.append(f"data.n_examples must be positive (got {self.n_examples})")
        want = ctx.method.data_kinds
        if self.kind != "auto" and self.kind not in want:
            errors.append(
                f"data.kind={self.kind} does not fit method={ctx.method.name}, which trains on "
                f"{'/'.join(want)}; set data.kind=auto"
            )
        return errors

    def place(self, index: int) -> str:
        return f"generated example {index} (data=embedded, seed {self.seed})"

    def load(self, ctx: BuildContext):
        import datasets

        from memlab.data import synthetic

        kind = ctx.method.data_kinds[0] if self.kind == "auto" else self.kind
        gen = {
            "chat": synthetic.generate_chat,
            "text": synthetic.generate_text,
            "preference": synthetic.generate_preference,
        }[kind]
        rows = gen(
            self.n_examples, seed=self.seed, median_tokens=self.median_tokens,
            max_tokens=self.max_tokens,
        )
        return datasets.Dataset.from_list(rows)
