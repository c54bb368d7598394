"""summary.json's optional sections (:class:`memlab.measure.summary_types.Summary` holds them):
evaluation while training, a resumed run, checkpoint errors, the profiler's tables."""

from __future__ import annotations

import sys
from typing import Any, Literal

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # (typing_extensions comes with torch)
    from typing_extensions import NotRequired, TypedDict



class EvalBest(TypedDict):
    """The best evaluation so far."""

    step: int
    """Its step."""
    value: float
    """Its ``metric``."""
    checkpoint: str | None
    """The checkpoint ``train.save_best`` wrote for it (null: none)."""


class EvalStop(TypedDict):
    """Early stopping ended the run."""

    step: int
    """At this step."""
    reason: str
    """Why."""


class EvalSample(TypedDict):
    """A sample completion of a held-out prompt."""

    step: int
    """The evaluation's step."""
    prompt: str
    """The prompt, decoded."""
    completion: str
    """The completion."""


class Eval(TypedDict):
    """Evaluations on held-out data (``data.eval``)."""

    source: str
    """Where the held-out rows come from, in words."""
    examples: int
    """Held-out examples."""
    rows: int
    """Held-out rows (packed as the training rows are)."""
    tokens: int
    """Held-out tokens (after truncation)."""
    trainable_tokens: int | None
    """Held-out tokens the loss counts (null: the method does not count them)."""
    every: int
    """``train.eval_every``."""
    batch_size: int
    """Rows per evaluation micro-batch."""
    batch_size_asked: NotRequired[int]
    """``train.eval_batch_size`` when the held-out data could not fill it."""
    batch_note: NotRequired[str]
    """Why the micro-batches were smaller."""
    metric: str
    """What ``train.best_metric`` follows."""
    greater_is_better: bool
    """Whether a larger ``metric`` is better."""
    final: dict[str, float | None] | None
    """The last evaluation: ``step`` and each metric by name (``loss``, ``rewards/*``...)."""
    best: EvalBest | None
    """The best evaluation (null: none yet)."""
    stopped_early: EvalStop | None
    """Early stopping (null: it did not stop the run)."""
    history: list[dict[str, float | None]]
    """Every evaluation: ``step``, each metric, ``seconds``."""
    samples: list[EvalSample]
    """Sample completions (``train.eval_samples``)."""
    seconds: float
    """All evaluations together (not in tokens/s)."""


class ResumeChange(TypedDict):
    """A setting that differs from the checkpoint's (``train.resume_allow``)."""

    checkpoint: Any
    """The checkpoint's value."""
    run: Any
    """This run's value."""


class ResumeSkipped(TypedDict):
    """A newer checkpoint ``resume_from=latest`` passed over."""

    checkpoint: str
    """Its directory."""
    why: str
    """What is wrong with it."""


class Resume(TypedDict):
    """Where the run resumed from (``train.resume_from``)."""

    from_: str
    """The checkpoint directory (key ``from``)."""
    requested: str
    """``train.resume_from`` as given (``latest``, a path)."""
    step: int
    """The checkpoint's step."""
    changed: dict[str, ResumeChange]
    """The settings that differ, by config key; and the versions of torch, transformers, peft
    or memlab that differ from those the checkpoint was written with (``versions.<package>``:
    recorded, not refused)."""
    skipped: NotRequired[list[ResumeSkipped]]
    """Damaged newer checkpoints passed over."""
    verified: NotRequired[bool]
    """Whether every file of the checkpoint matched the sha256 recorded when it was written
    (false: a checkpoint from a memlab that recorded none, resumed unverified)."""


class CheckpointErrors(TypedDict):
    """Checkpoints that could not be written (the run's status is then ``failed``)."""

    errors: list[str]
    """Each one, with why."""


class ProfileBucket(TypedDict):
    """Self time of one kind of operator."""

    s: float
    """Seconds."""
    share: float
    """Share of the summed self time (0-1)."""


class ProfileOp(TypedDict):
    """One operator of the profiled step."""

    op: str
    """Its name."""
    calls: int
    """Calls."""
    self_s: float
    """Self time, seconds."""
    share: float
    """Share of the summed self time (0-1)."""


class Profile(TypedDict):
    """``measure.profile_step``: where the profiled step's time went (its trace and tables are
    under ``<run dir>/profile``)."""

    step: int
    """The profiled step."""
    wall_s: float
    """Its wall time, seconds."""
    self_s: float
    """The operators' summed self time, seconds."""
    time: Literal["host", "device"]
    """Whose time: the host's (CPU) or the kernels' (CUDA)."""
    phases_s: dict[str, float]
    """Seconds of each phase."""
    buckets: dict[str, ProfileBucket]
    """Self time by kind of operator (matmul, attention, optimizer...)."""
    top_ops: list[ProfileOp]
    """The operators with the most self time."""
