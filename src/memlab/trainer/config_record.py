"""The configuration a checkpoint records, and how a resumed run is compared with it.

A checkpoint records the run's validated configuration (:func:`record`: every group's typed
config with its option ``name``, plus ``train`` and ``measure``). Resuming compares the
checkpoint's record with the new run's, key by key (``group.key``, ``train.lr``), and refuses
every difference that changes what is trained unless the user named it in
``train.resume_allow`` (a key, or a prefix of keys such as a whole group). What cannot change
training is not compared (:data:`NOT_COMPARED`):

- bookkeeping: where and when checkpoints are written, how a run resumes, progress and
  logging (``train.save_*``, ``train.keep_last``, ``train.resume_*``, ``train.progress``,
  ``train.log_every``), what is measured (``measure``) and where it is logged (``logger``),
  how the held-out data is evaluated (``train.eval_*``, ``train.best_metric``,
  ``train.greater_is_better``, ``train.early_stop``; which rows are held out, ``data.eval``,
  changes what is trained and is compared);
- the device (``train.device``: a checkpoint may move between machines);
- memory-only techniques that compute the same arithmetic (``train.gradient_checkpointing``,
  ``train.checkpoint_every``: recomputation; ``offload``: activations moved off the device and
  back), which are exactly what one changes to fit a resumed run into memory;
- connection settings (``distributed.timeout_s``, ``distributed.master_port``,
  ``model.local_files_only``, the generation server's ``host`` / ``port`` / timeouts);
- ``generation`` when neither run's method generates.

A key the checkpoint does not record (a knob added by a later memlab) is compared with the
knob's default, the behaviour of the memlab that wrote the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from memlab.config import DEFAULT_STEPS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from memlab.context import BuildContext

NOT_COMPARED = (
    "measure", "logger", "offload", "optimizer.in_backward",
    "train.save_every", "train.save_final", "train.save_merged", "train.keep_last",
    "train.resume_from", "train.resume_allow", "train.resume_root", "train.progress",
    "train.log_every", "train.device", "train.gradient_checkpointing", "train.checkpoint_every",
    "train.eval_every", "train.eval_batch_size", "train.eval_samples", "train.eval_max_new_tokens",
    "train.best_metric", "train.greater_is_better", "train.early_stop", "train.save_best",
    "distributed.timeout_s", "distributed.master_port", "model.local_files_only",
    "generation.host", "generation.port", "generation.server_timeout_s",
    "generation.request_timeout_s",
)
"""Keys (or prefixes of keys) that cannot change what is trained; see the module docstring."""

ABSENT = "(not set)"


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a config value (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def _knobs(opt: DataclassInstance, defaults: bool = False) -> dict[str, Any]:
    """Every field of the config ``opt`` (its default, with ``defaults``), as plain JSON."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(opt):
        if defaults:
            if f.default is not dataclasses.MISSING:
                out[f.name] = _plain(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = _plain(f.default_factory())
        else:
            out[f.name] = _plain(getattr(opt, f.name))
    return out


def record(ctx: BuildContext) -> dict[str, Any]:
    """The configuration of the run ``ctx`` describes, as plain JSON: ``{group: {name, knobs},
    train: {...}, measure: {...}, generates: bool}``."""
    out: dict[str, Any] = {g: {"name": opt.name, **_knobs(opt)}
                           for g, opt in ctx.groups().items()}
    out["train"] = _knobs(ctx.train)
    out["train"]["steps"] = ctx.train.fixed_steps()  # the default's 20, as older records hold
    out["measure"] = _knobs(ctx.measure)
    out["generates"] = ctx.method.as_generating() is not None
    return out


def defaults(ctx: BuildContext) -> dict[str, Any]:
    """Each knob's default for the options ``ctx`` chose (what an older record lacks)."""
    out: dict[str, Any] = {g: {"name": opt.name, **_knobs(opt, defaults=True)}
                           for g, opt in ctx.groups().items()}
    out["train"] = _knobs(ctx.train, defaults=True)
    out["train"]["steps"] = DEFAULT_STEPS
    out["measure"] = _knobs(ctx.measure, defaults=True)
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are values)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def matches(key: str, patterns) -> bool:
    """Whether ``key`` is one of ``patterns`` or lies under one (``peft`` covers ``peft.r``)."""
    return any(key == p or key.startswith(p + ".") for p in patterns)


@dataclasses.dataclass(frozen=True)
class Difference:
    key: str
    checkpoint: Any
    run: Any

    def line(self) -> str:
        return f"{self.key}: {_show(self.checkpoint)} (checkpoint) -> {_show(self.run)} (this run)"


def _show(value: Any) -> str:
    return value if value == ABSENT else json.dumps(value)


def differences(old: dict[str, Any], new: dict[str, Any],
                known_defaults: dict[str, Any] | None = None) -> list[Difference]:
    """Every compared key whose value differs between record ``old`` (the checkpoint's) and
    ``new`` (this run's). A group whose option changed is one difference (``peft: none ->
    lora``), not one per knob."""
    skip = list(NOT_COMPARED)
    if not old.get("generates") and not new.get("generates"):
        skip.append("generation")
    out: list[Difference] = []
    groups = [k for k in new if isinstance(new[k], dict)]
    base = flatten(known_defaults or {})
    for g in groups:
        if matches(g, skip):
            continue
        o, n = old.get(g), new[g]
        if o is None:
            out.append(Difference(g, ABSENT, n.get("name", n)))
            continue
        if "name" in n and o.get("name") != n.get("name"):
            out.append(Difference(g, o.get("name"), n["name"]))
            continue
        fo, fn = flatten(o, g + "."), flatten(n, g + ".")
        for key in sorted(fn):
            if matches(key, skip):
                continue
            if key in fo:
                was = fo[key]
            elif key in base:  # a knob the checkpoint's memlab did not have: its default
                was = base[key]
            else:
                was = ABSENT
            if was != fn[key]:
                out.append(Difference(key, was, fn[key]))
    return out


def refusal(where: str, diffs: list[Difference]) -> str:
    """One message listing every refused difference and how to accept them."""
    keys = ",".join(d.key for d in diffs)
    body = "\n".join(f"      {d.line()}" for d in diffs)
    return (f"train.resume_from={where}: this run's configuration differs from the checkpoint's "
            f"in {len(diffs)} setting(s) that change training:\n{body}\n"
            "    resume with the checkpoint's values, or name the settings you mean to change: "
            f"train.resume_allow='[{keys}]'")
