"""summary.json's one definition (:class:`Summary`): TypedDicts, one per section, each key with
its type and a docstring (units in the names, ``_bytes``, ``_s``, or in the docstring); the
:data:`SCHEMA_VERSION` it is at, and what each status must hold (:data:`BY_STATUS`).
:mod:`memlab.measure.schema` makes the JSON Schema and the docs from it and checks records.
Light (no torch)."""


from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # (typing_extensions comes with torch)
    from typing_extensions import NotRequired, TypedDict

from memlab.measure.summary_sections import (  # noqa: E402 F401 (sections of the record)
    CheckpointErrors,
    Eval,
    EvalBest,
    EvalSample,
    EvalStop,
    Profile,
    ProfileBucket,
    ProfileOp,
    Resume,
    ResumeChange,
    ResumeSkipped,
)

SCHEMA_VERSION = 1
"""The layout of summary.json that this memlab writes. 0: the layout before the record had a
version (memlab 0.1.0 up to the typed record): the same keys, written without
``schema_version``."""

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "assets" / "summary.schema.json"
"""The JSON Schema of :class:`Summary`, shipped in the package (``scripts/gen_summary_schema.py``
writes it)."""

Status = Literal["ok", "oom", "invalid", "nan", "failed", "killed", "timeout", "interrupted",
                 "not_run"]
"""How the job ended (:data:`memlab.measure.outcome.STATUSES`, in the same order)."""


# ------------------------------------------------------------------------------ the record

class Job(TypedDict):
    """What Hydra says about the job (empty for a run started from Python:
    :func:`memlab.run.run`)."""

    name: NotRequired[str | None]
    """Hydra's job name (``train``...)."""
    num: NotRequired[int | None]
    """The job's number in its sweep; null for a single run."""
    sweep_dir: NotRequired[str | None]
    """The sweep's directory (absolute); null for a single run."""
    outputs: NotRequired[list[str]]
    """The outputs trees where ``train.resume_from=latest`` looks (absolute paths; not in a
    record the sweep launcher wrote for a job that wrote none)."""
    moved: NotRequired[str]
    """Why the run's directory is a fallback directory, when it could not use its own."""
    record_id: NotRequired[str]
    """A random id of this run (a sweep job's is its launcher's, ``$MEMLAB_RECORD_ID``): a record
    found at a fallback path is taken for this job's only when it carries this id."""


class Device(TypedDict):
    """The device the run trained on (rank 0's, for a run of several processes)."""

    type: Literal["cpu", "cuda"]
    """The kind of device."""
    name: str
    """The GPU's name, or the CPU's (``platform.processor()``)."""
    count: int
    """GPUs visible to the process (1 on the CPU)."""
    threads: NotRequired[int]
    """The CPU only: torch's intra-op threads."""
    total_memory_bytes: NotRequired[int]
    """CUDA only: the GPU's memory, in bytes."""
    capability: NotRequired[str]
    """CUDA only: the compute capability, ``major.minor``."""
    visible_devices: str | None
    """``CUDA_VISIBLE_DEVICES`` as set (null: unset)."""
    cpu_bf16_env: NotRequired[str]
    """``MEMLAB_CPU_BF16`` as set, when it is: the CPU's bf16 kernels taken as said."""


class PeakAt(TypedDict):
    """Where the overall peak happened."""

    step: int
    """The step (counted from 0)."""
    phase: str
    """The phase (``forward``, ``backward``, ``optimizer``, ``generate``, ``eval``)."""


class CudaMemory(TypedDict):
    """CUDA's caching allocator, over the tracked steps."""

    peak_allocated_bytes: int
    """The allocator's peak of allocated bytes (the headline peak on CUDA)."""
    peak_reserved_bytes: int
    """The allocator's peak of reserved bytes (what ``nvidia-smi`` shows, near enough)."""
    tracker_peak_bytes: int
    """The tracker's own peak, in bytes (what it can attribute to a category)."""


class ParamCounts(TypedDict):
    """A model's parameters."""

    total: int
    """Parameters (elements)."""
    trainable: int
    """Parameters that require a gradient (elements)."""
    bytes: int
    """Bytes of all parameters."""


class Wrapper(TypedDict):
    """What the distributed wrapper holds of its own (each option reports its keys; none for
    ``distributed=single``)."""

    bucket_bytes: NotRequired[int]
    """DDP: bytes of its gradient buckets (resident for the whole run)."""
    buckets: NotRequired[int]
    """DDP: how many buckets."""
    gradient_as_bucket_view: NotRequired[bool]
    """DDP: gradients are views into the buckets."""
    units: NotRequired[int]
    """FSDP2: the sharded units (decoder layers + the root)."""
    reshard_after_forward: NotRequired[bool]
    """FSDP2: parameters are freed again after the forward."""
    zero_stage: NotRequired[int]
    """DeepSpeed: the ZeRO stage."""
    offload_optimizer: NotRequired[str]
    """DeepSpeed: where optimizer states live (``none``, ``cpu``...)."""
    offload_param: NotRequired[str]
    """DeepSpeed: where parameters live (``none``, ``cpu``...)."""
    gather_for_generation: NotRequired[bool]
    """DeepSpeed: ZeRO-3 parameters are gathered to generate."""


class Memory(TypedDict):
    """What the memory probe measured over the tracked steps (``measure.memory_steps``)."""

    device: str
    """The torch device (``cpu``, ``cuda:0``)."""
    source: Literal["tracker", "cuda_allocator"]
    """Where ``peak_bytes`` comes from: torch's MemTracker (CPU), CUDA's allocator (GPU)."""
    peak_bytes: int
    """The peak, in bytes (on CUDA the allocator's allocated peak)."""
    by_category: dict[str, int]
    """Bytes at the peak by category (``parameters``, ``gradients``, ``optimizer``,
    ``activations``, ``other``): they sum to the peak."""
    by_phase: dict[str, int]
    """The peak of each phase, in bytes (``forward``, ``backward``, ``optimizer``; ``generate``
    for online methods, ``eval`` with held-out data)."""
    by_phase_category: dict[str, dict[str, int]]
    """Each phase's peak by category, in bytes."""
    peak_at: PeakAt | None
    """Where the peak happened (null: nothing tracked)."""
    tracked_steps: list[int]
    """The steps measured by the tracker."""
    tracked_step_peaks: list[int]
    """The peak of each tracked step, in bytes (same order)."""
    cuda: CudaMemory | None
    """CUDA's allocator (null on the CPU)."""
    generation_engine: NotRequired[dict[str, int | None]]
    """What a generation engine (vLLM) holds outside the trainer's tensors, in bytes by what it
    is (``weights_bytes``, ``kv_cache_bytes``...)."""
    offload: NotRequired[dict[str, int]]
    """``offload=activations``: the hooks' counters (``offloaded_tensors``/``_bytes``,
    ``kept_<reason>``, ``reloaded_*``, ``host_bytes``, ``peak_host_bytes``; bytes and counts)."""
    params: NotRequired[ParamCounts]
    """The policy's parameters."""
    models: NotRequired[dict[str, ParamCounts]]
    """Every model the run holds, by role (``policy``, ``reference``, ``value``...)."""
    distributed: NotRequired[Wrapper]
    """What the distributed wrapper holds of its own."""
    peak_bytes_max_rank: NotRequired[int | None]
    """Several processes: the largest peak of any rank, in bytes."""


class Throughput(TypedDict):
    """Speed over the timed steps (after ``measure.warmup_steps``; tracked and profiled steps
    are not timed)."""

    tokens_per_s: float | None
    """Non-padding tokens per second (summed over ranks); null: no timed step."""
    tokens_per_s_std: NotRequired[float | None]
    """The spread (standard deviation) of the timed steps' tokens/s; null under two."""
    samples_per_s: float | None
    """Rows per second."""
    step_time_s: float | None
    """Seconds per optimizer step."""
    timed_steps: NotRequired[int]
    """How many steps were timed."""
    tokens: int
    """Non-padding tokens trained (all steps)."""
    note: NotRequired[str]
    """Why nothing was timed, or how the numbers were combined."""
    tokens_per_s_rank0: NotRequired[float | None]
    """Several processes: rank 0's own tokens/s."""


class ChatTemplate(TypedDict):
    """Rows memlab's training template rendered (the stock one cannot split them)."""

    training_template: str | None
    """The template's name (``qwen3``, ``mistral-v3``...)."""
    rows: int
    """Rows it rendered."""


class Unsplittable(TypedDict):
    """Rows left out because the chat template cannot split them (``data.on_unsplittable=skip``)."""

    skipped: int
    """How many."""
    first: list[str]
    """Where the first ones come from (file and line, hub row)."""
    reason: str | None
    """Why the first could not be split."""


class MixtureSource(TypedDict):
    """One source of ``data=mixture``."""

    rows: int
    """Rows it gave."""
    weight: NotRequired[float]
    """Its weight, when the mixture is weighted."""
    count: NotRequired[int]
    """Its asked count of rows, when the mixture counts."""


class DataFile(TypedDict):
    """A file the rows or the held-out rows were read from."""

    input: str
    """The input it belongs to: ``data``, ``data.<label>`` (a mixture's source) or
    ``data.eval`` (a held-out file), as a checkpoint's fingerprints and ``train.resume_allow``
    name it."""
    path: str
    """Its absolute path."""
    bytes: int
    """Its size."""
    sha256: str
    """The SHA-256 of its contents (what keys its cached rows and what a resume compares)."""


class Data(TypedDict):
    """What preparing the data did to the tokens."""

    examples: int
    """Examples read (pairs count twice for KTO's unpaired form)."""
    rows: int
    """Training rows after packing."""
    tokens_in: int
    """Tokens before truncation and packing."""
    tokens_dropped: int
    """Tokens lost to truncation or to packing overflow."""
    examples_dropped: int
    """Examples left out (too long for the method, unsplittable...)."""
    fill_ratio: float | None
    """Packing: the share of each row's length that holds tokens (null: no packing)."""
    packing_seconds: float | None
    """Seconds packing took (null: no packing)."""
    trainable_tokens: int | None
    """Tokens the loss trains on; null where the method does not count them."""
    hollow_rows: int | None
    """Examples that carry no training signal; null where the method does not count them."""
    padding_fraction: NotRequired[float]
    """The share of padding in the trained batches (0-1)."""
    tokens_trained: NotRequired[int]
    """Non-padding tokens trained (summed over ranks)."""
    micro_batches: NotRequired[int]
    """Preference packing: the micro-batches the groups were packed into."""
    units_split: NotRequired[int]
    """Preference packing: units split across rows."""
    converted: NotRequired[dict[str, int]]
    """Rows converted on load, by what was converted (ShareGPT, Alpaca, renamed columns)."""
    chat_template: NotRequired[ChatTemplate]
    """Rows rendered with memlab's training template."""
    unsplittable: NotRequired[Unsplittable]
    """Rows skipped as unsplittable."""
    sources: NotRequired[dict[str, MixtureSource]]
    """``data=mixture``: each source by its label."""
    files: NotRequired[list[DataFile]]
    """Every file the data and the held-out data were read from, with its SHA-256 (none for
    generated data or a hub repository)."""
    hollow_warning: NotRequired[str]
    """The share of hollow examples is above ``data.max_hollow_fraction``."""
    groups: NotRequired[int]
    """Online methods: reward groups trained."""
    hollow_groups: NotRequired[int]
    """Online methods: groups whose rewards had zero variance (they train nothing)."""
    hollow_groups_warning: NotRequired[str]
    """Their share is above ``data.max_hollow_fraction``."""
    empty_completions: NotRequired[int]
    """Preference / KTO / reward data: completions with no tokens."""
    desirable: NotRequired[int]
    """KTO: desirable examples."""
    undesirable: NotRequired[int]
    """KTO: undesirable examples."""


class Train(TypedDict):
    """What the training loop did (all of it, or the steps done before the end)."""

    final_loss: float | None
    """The last step's loss (null: no step, or not finite)."""
    steps: int
    """Optimizer steps done."""
    steps_planned: int
    """``train.steps``, or the steps ``train.epochs`` came to."""
    epochs: NotRequired[int]
    """``train.epochs``: whole passes over the training rows (after packing; an online
    method's prompts)."""
    steps_per_epoch: NotRequired[int]
    """With ``epochs``: the optimizer steps of one pass."""
    loss_curve: list[float | None]
    """Every step's loss (null where not finite)."""
    final_metrics: dict[str, float | None]
    """The last step's logged metrics by name (``train/lr``, ``rewards/margins``...)."""
    curves: dict[str, list[float | None]]
    """Every logged metric, one value per step, by name."""
    checkpoint: str | None
    """The newest checkpoint this run wrote (null: none)."""
    nan_step: NotRequired[int]
    """Status ``nan``: the step whose loss was not finite (from 1)."""


class RankRecord(TypedDict):
    """One rank of a run of several processes, as merged."""

    status: str
    """How the rank ended (a status)."""
    error: str | None
    """Why, when not ``ok``."""
    peak_bytes: int | None
    """Its peak, in bytes."""
    by_category: dict[str, int] | None
    """Its bytes at the peak by category."""
    cuda: CudaMemory | None
    """Its CUDA allocator."""
    wrapper: Wrapper | None
    """What its distributed wrapper held."""
    tokens_per_s: float | None
    """Its own tokens/s."""
    tokens_trained: int | None
    """Its non-padding tokens trained."""


class Distributed(TypedDict):
    """A run of several processes: every rank."""

    world_size: int
    """Processes."""
    exit_codes: list[int | None]
    """Each rank's exit code (negative: the signal that ended it; null: still running)."""
    ranks: list[RankRecord | None]
    """Each rank's record (null: it wrote none)."""


class Summary(TypedDict):
    """summary.json: one job, however it ended. The same record is each rank's
    ``ranks/rank<r>.json`` (with ``rank``)."""

    schema_version: int
    """The layout of this record (:data:`SCHEMA_VERSION`)."""
    status: Status
    """How the job ended (ok, oom, invalid, nan, failed, killed, timeout, interrupted, not_run:
    [reliability](reliability.md))."""
    error: str | None
    """Why it did not end ``ok`` (null when it did)."""
    choices: dict[str, str]
    """The user's group choices (``method: sft``...)."""
    resolved: NotRequired[dict[str, str]]
    """Groups whose option stands for another in this run (``precision: bf16_mixed`` for
    ``auto``)."""
    overrides: list[str]
    """The command line's overrides."""
    run_dir: str
    """The run's directory."""
    job: Job
    """What Hydra says about the job."""
    config: NotRequired[dict[str, Any]]
    """The composed config (its keys are the config groups'; each group's typed config, in the
    [reference](config/index.md), says what they are)."""
    memory: Memory | None
    """What was measured of memory (null: nothing trained)."""
    throughput: Throughput | None
    """How fast (null: nothing trained)."""
    data: Data | None
    """What preparing the data did (null: not prepared)."""
    train: Train | None
    """What the loop did (null: it did not start)."""
    eval: NotRequired[Eval | None]
    """Evaluations on held-out data (``data.eval``;
    [evaluation](config/train.md#evaluation-while-training))."""
    logger: NotRequired[dict[str, Any] | None]
    """The logger's run and where each of its settings came from; its keys are the logger
    option's (for W&B: ``option``, ``project``, ``entity``, ``mode``, ``group``, ``run_name``,
    ``tags``..., ``sources``, ``id``, ``url``)."""
    versions: dict[str, str] | None
    """Installed versions by package (``python``, ``memlab``, ``torch``...)."""
    device: Device | None
    """The device (null: the run did not get to it)."""
    wall_time_s: float | None
    """Seconds from the start of the job to its record."""
    resume: NotRequired[Resume]
    """Where the run resumed from."""
    checkpoint: NotRequired[CheckpointErrors]
    """Checkpoints not written."""
    profile: NotRequired[Profile]
    """``measure.profile_step``'s breakdown."""
    rank: NotRequired[int]
    """A rank's own record (``ranks/rank<r>.json``): its rank."""
    signal: NotRequired[str]
    """The signal that stopped the job (``SIGTERM``...)."""
    distributed: NotRequired[Distributed]
    """A run of several processes: its ranks."""
    write_error: NotRequired[str]
    """Why this record is not where it was meant to be (the fallback path it went to)."""
    recorded_status: NotRequired[str | None]
    """The sweep launcher changed the status: what the job itself had recorded."""
    exit_code: NotRequired[int]
    """The sweep launcher: the job process's exit code (negative: the signal)."""


RENAMED = {"from_": "from"}
"""Keys spelled differently in Python (a keyword) and in the record."""


class Rule(typing.NamedTuple):
    """What a status asks beyond the keys every record has."""

    required: tuple[str, ...] = ()
    """Keys it must hold."""
    not_null: tuple[str, ...] = ()
    """Keys that must not be null."""
    null: tuple[str, ...] = ()
    """Keys that must be null."""
    job_only: tuple[str, ...] = ()
    """Keys a job's own record must hold and a rank's (``ranks/rank<r>.json``, with ``rank``)
    does not: the launcher's process holds the composed config, the ranks read it."""


_MEASURED = ("memory", "throughput", "data", "train", "versions", "device", "wall_time_s")
_WHY = Rule(not_null=("error",))

BY_STATUS: dict[str, Rule] = {
    "ok": Rule(required=("resolved",), not_null=_MEASURED, null=("error",),
               job_only=("config",)),
    "oom": _WHY,
    "invalid": _WHY,
    "nan": _WHY,
    "failed": _WHY,
    "killed": _WHY,
    "timeout": _WHY,
    "interrupted": Rule(required=("signal",), not_null=("error",)),
    "not_run": _WHY,
}
"""Each status's rule: an ``ok`` job passed validation (``config``, ``resolved``) and measured
everything; any other says why (``error``); ``interrupted`` names the signal."""
