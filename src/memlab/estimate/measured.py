"""What one fake build and its tracked steps measured (:class:`Measured`): made by
:func:`memlab.estimate.fake.measure`, summarised by :func:`memlab.estimate.fake.summarize`, and
made for the run's full depth from two shallower ones by :mod:`memlab.estimate.layers` (which
:mod:`memlab.estimate.fake` imports: the type is here, below both)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlab.estimate.batch import Candidate
    from memlab.measure.memory import MemoryProbe
    from memlab.protocols import BuildContext


@dataclasses.dataclass
class Measured:
    """What one fake build and its tracked steps measured, before it is summarised: the probe
    with its phases, the batches and their descriptions, the model's sizes."""

    ctx: BuildContext
    notes: list[str]
    probe: MemoryProbe
    ran: list[tuple[int, int]]
    """(candidate, run step) of each tracked step, in order."""
    run_steps: list[int]
    cands: list[Candidate]
    eval_cands: list[Candidate]
    eval_phase: list[int]
    """Each held-out candidate's eval phase: its index in the tracker's phase log."""
    trained: list[dict]
    length: int | None
    micro: int
    model: dict[str, Any]
    """The policy's parameter sizes as placed, its config, the models in training."""
    flops: int | None
    assumed: dict[str, int]
    decode_skipped: bool
    offload: dict[str, Any] | None
    timing: dict[str, float]
    layers: Any = None
    """:class:`memlab.estimate.layers.LayerRecord` of a run measured for extrapolation."""
