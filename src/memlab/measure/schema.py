"""summary.json's one definition: the typed record every run, rank and launcher writes, its
``schema_version``, the JSON Schema made from it, and the check every reader can run.

The record is :class:`Summary`: TypedDicts, one per section, each key with its type and a
docstring (units are in the names: ``_bytes``, ``_s``; or in the docstring). An object whose
keys are fixed is closed (a key not defined here is an error); a map whose keys are data (memory
by category or phase, a method's curves, the versions of packages) is a map from names to one
type. What each status must hold beyond the keys every record has is :data:`BY_STATUS`.

``scripts/gen_summary_schema.py`` writes :func:`json_schema` to
``memlab/assets/summary.schema.json`` (shipped in the package; a test fails when it is stale),
and the docs build renders :func:`reference` into the summary.json section of
``docs/measurement.md``. :func:`check` validates a record against the shipped schema with a
small checker of its own (no dependency); :func:`read` takes a record of any version: the
current one is checked as it is, an older one is checked by the rules of its layout and
upgraded (:data:`UPGRADES`), a newer one is refused with the version it has.

A change that adds, removes or retypes a key changes the definition here, bumps
:data:`SCHEMA_VERSION` and adds the upgrade from the previous version to :data:`UPGRADES`.

This module is light (no torch): ``memlab report`` and the sweep launcher import it.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # (typing_extensions comes with torch)
    from typing_extensions import NotRequired, TypedDict

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
    """``train.steps``."""
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
    """The settings that differ, by config key."""
    skipped: NotRequired[list[ResumeSkipped]]
    """Damaged newer checkpoints passed over."""


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


_MEASURED = ("memory", "throughput", "data", "train", "versions", "device", "wall_time_s")
_WHY = Rule(not_null=("error",))

BY_STATUS: dict[str, Rule] = {
    "ok": Rule(required=("config", "resolved"), not_null=_MEASURED, null=("error",)),
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


# ------------------------------------------------------------------------- the JSON Schema

_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean",
           type(None): "null"}


def _hints(cls: type) -> dict[str, tuple[Any, bool]]:
    """``{record key: (type, required)}`` of a TypedDict, in definition order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for name, tp in hints.items():
        required = True
        if get_origin(tp) is NotRequired:
            tp, required = get_args(tp)[0], False
        out[RENAMED.get(name, name)] = (tp, required)
    return out


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__total__")


def _type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if tp is Any:
        return {}
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    origin = get_origin(tp)
    if origin is Literal:
        return {"enum": list(get_args(tp))}
    if origin in (Union, types.UnionType):
        parts = [_type_schema(a, defs) for a in get_args(tp)]
        if all(set(p) == {"type"} for p in parts):
            return {"type": [p["type"] for p in parts]}
        return {"anyOf": parts}
    if origin is list:
        return {"type": "array", "items": _type_schema(get_args(tp)[0], defs)}
    if origin is dict:
        key, value = get_args(tp)
        if key is not str:
            raise TypeError(f"summary maps have string keys, not {key}")
        return {"type": "object", "additionalProperties": _type_schema(value, defs)}
    if _is_typeddict(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # (placeholder: a cycle would end here)
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    raise TypeError(f"no JSON Schema for {tp!r}")


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    docs = key_docs(cls)
    props, required = {}, []
    for key, (tp, req) in _hints(cls).items():
        props[key] = {**_type_schema(tp, defs), "description": docs.get(key, "")}
        if req:
            required.append(key)
    return {"type": "object", "description": _doc(cls), "properties": props,
            "required": required, "additionalProperties": False}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :class:`Summary` at :data:`SCHEMA_VERSION`: every
    fixed-key object closed (``additionalProperties: false``), the keys every record has
    required, and each status's rule (:data:`BY_STATUS`) as an ``if``/``then``."""
    defs: dict[str, Any] = {}
    top = _object_schema(Summary, defs)
    top["properties"]["schema_version"]["const"] = SCHEMA_VERSION
    rules = []
    for status, rule in BY_STATUS.items():
        then: dict[str, Any] = {}
        if rule.required:
            then["required"] = list(rule.required)
        checks: dict[str, Any] = {k: {"not": {"type": "null"}} for k in rule.not_null}
        checks.update({k: {"type": "null"} for k in rule.null})
        if checks:
            then["properties"] = checks
        rules.append({"if": {"properties": {"status": {"const": status}}}, "then": then})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://memlab/summary.schema.json#v{SCHEMA_VERSION}",
            "title": "memlab summary.json", **top, "allOf": rules,
            "$defs": dict(sorted(defs.items()))}


def schema_text() -> str:
    """:func:`json_schema` as the shipped file holds it."""
    return json.dumps(json_schema(), indent=2) + "\n"


@lru_cache(maxsize=1)
def shipped_schema() -> dict[str, Any]:
    """The schema shipped in the package (:data:`SCHEMA_PATH`)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------ docs

def _doc(cls: type) -> str:
    import inspect

    return inspect.cleandoc(cls.__doc__ or "")


def key_docs(cls: type) -> dict[str, str]:
    """Each key's docstring (the string right below ``key: type``), read from the source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    docs = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            name = stmt.target.id
            docs[RENAMED.get(name, name)] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _md(text: str) -> str:
    """A docstring's reST markup as Markdown (``x`` and :data:`x` -> `x`), on one line."""
    import re

    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(text.split()))
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _type_text(tp: Any) -> str:
    if tp is Any:
        return "any"
    if tp in _SIMPLE:
        return {int: "int", float: "float", str: "str", bool: "bool", type(None): "null"}[tp]
    origin = get_origin(tp)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_text(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_text(get_args(tp)[0])}]"
    if origin is dict:
        return f"map[str, {_type_text(get_args(tp)[1])}]"
    if _is_typeddict(tp):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    return str(tp)


def reference() -> str:
    """The summary.json section of the docs (``<!-- memlab:summary -->``): each object of the
    record, its keys with their types, whether each is always there, and their docstrings;
    then each status's rule."""
    order: list[type] = []

    def walk(tp: Any) -> None:
        if _is_typeddict(tp):
            if tp in order:
                return
            order.append(tp)
            for sub, _ in _hints(tp).values():
                walk(sub)
        for arg in get_args(tp):
            walk(arg)

    walk(Summary)
    out = [f"`schema_version` {SCHEMA_VERSION}. A key marked *always* is in every record "
           "(null where the type allows it); the others only where they apply. An object "
           "below is closed: no other key is allowed; a `map` holds any names.", ""]
    for cls in order:
        out += [f"### {cls.__name__}", "", _md(_doc(cls)), "",
                "| key | type | | what it is |", "|---|---|---|---|"]
        docs = key_docs(cls)
        for key, (tp, req) in _hints(cls).items():
            doc = _md(docs.get(key, "")).replace("|", "\\|")
            out.append(f"| `{key}` | {_type_text(tp)} | {'always' if req else ''} | {doc} |")
        out.append("")
    out += ["### By status", "", "| status | must hold | not null | null |", "|---|---|---|---|"]
    for status, rule in BY_STATUS.items():
        cells = [", ".join(f"`{k}`" for k in keys) for keys in rule]
        out.append(f"| `{status}` | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ checking

_JSON_TYPES = {"object": "an object", "array": "a list", "string": "a string",
               "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "null": "null"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is(value: Any, name: str) -> bool:
    got = _json_type(value)
    return got == name or (name == "number" and got == "integer")


def _kind(value: Any) -> str:
    return _JSON_TYPES.get(_json_type(value), _json_type(value))


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


class _Checker:
    """The part of JSON Schema that :func:`json_schema` uses: type, enum, const, properties,
    required, additionalProperties, items, anyOf, allOf, if/then, not, local $ref. ``open``:
    unknown keys allowed and nothing required (the unversioned layout)."""

    def __init__(self, schema: Mapping[str, Any], open_: bool = False):
        self.root, self.open = schema, open_

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        while "$ref" in schema:
            ref = schema["$ref"]
            if not ref.startswith("#/$defs/"):
                raise ValueError(f"unsupported $ref {ref}")
            schema = self.root["$defs"][ref[len("#/$defs/"):]]
        return schema

    def errors(self, value: Any, schema: Mapping[str, Any], at: str) -> list[str]:
        schema = self.resolve(schema)
        where = at or "the record"
        if "type" in schema:
            names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not any(_is(value, n) for n in names):
                want = " or ".join(_JSON_TYPES.get(str(n), str(n)) for n in names)
                return [f"{where}: expected {want}, got {_kind(value)} ({_shown(value)})"]
        if "const" in schema and value != schema["const"]:
            return [f"{where}: expected {_shown(schema['const'])}, got {_shown(value)}"]
        if "enum" in schema and value not in schema["enum"]:
            return [f"{where}: {_shown(value)} is not one of "
                    + ", ".join(_shown(v) for v in schema["enum"])]
        if "not" in schema and not self.errors(value, schema["not"], at):
            return [f"{where}: must not be {_shown(value)}"]
        if "anyOf" in schema:
            tried = [self.errors(value, s, at) for s in schema["anyOf"]]
            if all(tried):
                kinds = [self.resolve(s).get("type") for s in schema["anyOf"]]
                fits = [t for t, kind in zip(tried, kinds)
                        if isinstance(kind, str) and _is(value, kind)]
                if len(fits) == 1:  # the branch of the value's type: what is wrong inside
                    return fits[0]
                want = " or ".join(_JSON_TYPES.get(str(k), str(k)) for k in kinds)
                return [f"{where}: expected {want}, got {_kind(value)} ({_shown(value)})"]
        out: list[str] = []
        if isinstance(value, dict):
            props = schema.get("properties", {})
            if not self.open:
                out += [f"{where}: no key {k!r}" for k in schema.get("required", [])
                        if k not in value]
            for k, v in value.items():
                sub = f"{at}.{k}" if at else str(k)
                if k in props:
                    out += self.errors(v, props[k], sub)
                elif "additionalProperties" in schema:
                    extra = schema["additionalProperties"]
                    if extra is False:
                        if not self.open:
                            out.append(f"{where}: unknown key {k!r}")
                    elif isinstance(extra, Mapping):
                        out += self.errors(v, extra, sub)
        if isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                out += self.errors(item, schema["items"], f"{at}[{i}]")
        for sub_schema in schema.get("allOf", []):
            out += self.errors(value, sub_schema, at)
        if ("if" in schema and not self.open
                and not _Checker(self.root).errors(value, schema["if"], at)):
            out += self.errors(value, schema.get("then", {}), at)
        return out


def check(record: Any, schema: Mapping[str, Any] | None = None, *,
          open_: bool = False) -> list[str]:
    """Every way ``record`` differs from the schema (the shipped one, or ``schema``), each
    naming the key (``memory.peak_bytes: expected an integer, got a string ("lots")``); empty
    when it conforms. ``open_``: allow unknown keys and missing ones (only the types of the
    keys defined here are checked)."""
    schema = schema or shipped_schema()
    return _Checker(schema, open_).errors(record, schema, "")


def _from_v0(record: dict[str, Any]) -> dict[str, Any]:
    """The unversioned layout is version 1's without ``schema_version``."""
    return {"schema_version": 1, **record}


UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {0: _from_v0}
"""``version -> function``: a record of that version in the layout of the next one."""


class Unreadable(ValueError):
    """A record that is not a summary this memlab can read: the message says why."""


def read(record: Any) -> dict[str, Any]:
    """``record`` (a parsed summary.json of any version) checked and in today's layout; raises
    :class:`Unreadable` naming every problem, or the version this memlab cannot read.

    Version 0 (no ``schema_version``: written before the typed record) is checked leniently:
    the keys defined here must have their types (``"memory": "lots"`` is refused), while keys
    no longer written and keys it lacked are let be (its writers changed over time)."""
    if not isinstance(record, dict):
        raise Unreadable(f"the top level is {_kind(record)}, not an object")
    version = record.get("schema_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise Unreadable(f"schema_version {_shown(version)} is not a version (an integer)")
    if version > SCHEMA_VERSION:
        raise Unreadable(f"schema_version {version} is newer than this memlab reads "
                         f"(up to {SCHEMA_VERSION}): read it with a newer memlab")
    if version == 0:  # checked as it was written, then upgraded
        problems = check({**record, "schema_version": SCHEMA_VERSION}, open_=True)
        _raise(problems)
        return _upgrade(record, version)
    record = _upgrade(record, version)  # upgraded, then checked as today's
    _raise(check(record))
    return record


def _upgrade(record: dict[str, Any], version: int) -> dict[str, Any]:
    for v in range(version, SCHEMA_VERSION):
        record = UPGRADES[v](record)
    return record


def _raise(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise Unreadable("; ".join(problems[:5]) + more)
