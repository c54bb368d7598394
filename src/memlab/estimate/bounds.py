"""What an estimate refuses to build: a worst-case micro-batch too large to measure in bounded
memory and time (issue 43: ``train.batch_size=1000000`` or ``method.max_length=10000000`` grew
the estimator to 4-6 GB before anything was fake, the worst-case rows being Python lists).

The estimate measures its worst-case batches by building their rows for real (the method's own
``collate`` then makes the tensors the fake step reads), which costs host memory and time in
proportion to the tokens of a micro-batch. Up to :data:`MEASURED_TOKENS` tokens per micro-batch
(rows x length: ``2048 x 1024``) it measures, as always. Above, it answers without building the
batch, in this order:

1. **The token ids alone** (``rows x length`` int64 ids, a tensor every run holds) more than the
   largest card memlab knows: ``invalid``, naming the card. Instant.
2. **A measured lower bound** more than the largest card: ``invalid``, naming the card and the
   bound. The same configuration is measured at two smaller sizes on the axis that is too large
   (rows at the full length, or the length at up to 2 rows), each at most :data:`PROBE_TOKENS`
   tokens, and the bound continues the line through their two peaks to the asked size. Sound
   because the peak is a *convex* function of that size: at every point of the step the live
   tensors' sizes are polynomials of the rows (linear) or of the length (linear; quadratic for
   a dense ``[T, T]`` mask) with non-negative coefficients, the same ops run at any size (a
   chunked loss loops more often over chunks of the same size), and the largest of convex
   functions is convex; a convex function lies above the line through two of its points beyond
   them. A larger size of the other axis only adds tensors (the peak is monotone), so the
   length's bound at 2 rows holds for more rows. Only for rows of exactly ``length`` tokens
   (SFT-style worst cases, :func:`memlab.estimate.batch.candidates`): generated rows of other
   methods are not a fixed function of the size, and get no bound.
3. Otherwise ``invalid`` too, saying that the batch is more than the estimate measures and the
   bound it has (if any): estimate a smaller micro-batch (``train.grad_accum`` keeps the tokens
   per step).

``--from-data`` measures the run's own batches and is left to its data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memlab.estimate.options import CARDS, EstimateOptions, MiB, fmt_bytes

if TYPE_CHECKING:
    from memlab.context import BuildContext

MEASURED_TOKENS = 2048 * 1024
"""The most tokens (rows x length) of a worst-case micro-batch the estimate builds and measures;
about 0.3 GB of host memory and a minute on a CPU core at this size (the default tiny model)."""

PROBE_TOKENS = 16384
"""The most tokens of each of the two smaller batches the lower bound is measured at."""

ID_BYTES = 8
"""Bytes of a token id (int64, as every collate makes them)."""


def largest_card() -> tuple[str, int]:
    """The name and bytes of the largest card memlab knows (:data:`CARDS`)."""
    key = max(CARDS, key=lambda k: CARDS[k]["mib"])
    return CARDS[key]["name"], CARDS[key]["mib"] * MiB


@dataclasses.dataclass(frozen=True)
class Size:
    """A worst-case micro-batch's size: rows (train or held-out, the larger) x tokens a row."""

    rows: int
    length: int

    @property
    def tokens(self) -> int:
        return self.rows * self.length


def worst_case_size(ctx: BuildContext, opts: EstimateOptions) -> Size | None:
    """The size of the worst-case micro-batches the estimate would build; None where it builds
    none (``--from-data``) or knows no length (its own error says so)."""
    if opts.from_data:
        return None
    length = opts.length or ctx.method.row_layout(ctx).row_length
    if length is None:
        return None
    rows = ctx.train.batch_size
    if ctx.data.eval is not None:
        rows = max(rows, ctx.train.eval_rows())
    return Size(rows, int(length))


def _rows_of_length(ctx: BuildContext) -> bool:
    """Whether the worst-case rows are exactly ``length`` tokens each (SFT-style candidates,
    :func:`memlab.estimate.batch.candidates`), the case the lower bound is proven for."""
    method = ctx.method
    return (method.row_layout(ctx).supports_packing and method.as_group_packed() is None
            and method.as_generating() is None)


def _resized(ctx: BuildContext, opts: EstimateOptions, size: Size
             ) -> tuple[BuildContext, EstimateOptions]:
    train = dataclasses.replace(ctx.train, batch_size=size.rows,
                                eval_batch_size=size.rows if ctx.train.eval_batch_size else None)
    method = ctx.method
    if getattr(method, "max_length", None) is not None:  # (packing's row capacity follows it)
        method = dataclasses.replace(method, max_length=size.length)
    return (dataclasses.replace(ctx, train=train, method=method),
            dataclasses.replace(opts, length=size.length))


def _probes(ctx: BuildContext, opts: EstimateOptions, size: Size) -> tuple[Size, Size] | None:
    """The two smaller sizes the bound is measured at (module docstring), on the axis that is
    too large; None where no bound is proven."""
    if not _rows_of_length(ctx):
        return None
    if opts.length is not None and opts.length != getattr(ctx.method, "max_length", None):
        return None  # a --length other than the row capacity: the capacity would change too
    if size.length * min(size.rows, 4) <= PROBE_TOKENS:  # the rows are too many
        r1 = PROBE_TOKENS // size.length
        return Size(r1 // 2, size.length), Size(r1, size.length)
    rows = min(size.rows, 2)
    l1 = PROBE_TOKENS // rows
    return Size(rows, l1 // 2), Size(rows, l1)


def lower_bound(ctx: BuildContext, opts: EstimateOptions, size: Size,
                measure: Callable[[BuildContext, EstimateOptions], int]
                ) -> tuple[int, str] | None:
    """A lower bound of the peak at ``size`` from two measured smaller sizes (``measure`` gives
    a peak), and how it was found; None where none is proven (module docstring)."""
    probes = _probes(ctx, opts, size)
    if probes is None:
        return None
    small, large = probes
    p0, p1 = (measure(*_resized(ctx, opts, s)) for s in probes)
    if small.rows != large.rows:
        x0, x1, x, axis = small.rows, large.rows, size.rows, "rows"
    else:
        x0, x1, x, axis = small.length, large.length, size.length, "tokens a row"
    bound = max(p1, p1 + (x - x1) * (p1 - p0) // (x1 - x0))
    how = (f"measured {fmt_bytes(p0)} at {small.rows} x {small.length} tokens and "
           f"{fmt_bytes(p1)} at {large.rows} x {large.length}; the peak is convex in the "
           f"{axis}, so it is at least the line through these two at {x:,}")
    return bound, how


def refusal(ctx: BuildContext, opts: EstimateOptions,
            measure: Callable[[BuildContext, EstimateOptions], int]) -> str | None:
    """Why the estimate builds no worst-case batch for ``ctx`` (an ``invalid`` estimate's
    error), or None: it measures them as always (module docstring)."""
    size = worst_case_size(ctx, opts)
    if size is None or size.tokens <= MEASURED_TOKENS:
        return None
    card, card_bytes = largest_card()
    what = (f"a worst-case micro-batch of {size.rows:,} rows x {size.length:,} tokens "
            f"({size.tokens:,} tokens; train.batch_size={ctx.train.batch_size}"
            + (f", train.eval_batch_size={ctx.train.eval_batch_size}"
               if ctx.train.eval_batch_size else "") + ")")
    fix = ("; lower train.batch_size (train.grad_accum keeps the tokens per step) or the "
           "length (method.max_length, --length)")
    ids = size.tokens * ID_BYTES
    if ids > card_bytes:
        return (f"{what}: its token ids alone ({fmt_bytes(ids)} as int64) would exceed the "
                f"largest card memlab knows, {card} ({fmt_bytes(card_bytes)}){fix}")
    found = lower_bound(ctx, opts, size, measure)
    if found is not None and found[0] > card_bytes:
        bound, how = found
        return (f"{what} needs at least {fmt_bytes(bound)} ({how}): more than the largest "
                f"card memlab knows, {card} ({fmt_bytes(card_bytes)}){fix}")
    known = (f"; it needs at least {fmt_bytes(found[0])} ({found[1]})" if found is not None
             else "")
    return (f"{what} is more than memlab estimate builds and measures in bounded memory "
            f"({MEASURED_TOKENS:,} tokens a micro-batch){known}{fix}")


def peak_of(result: dict[str, Any]) -> int:
    """The peak of an :func:`memlab.estimate.fake.run_fake_step` result."""
    return int(result["raw"]["peak_bytes"])
