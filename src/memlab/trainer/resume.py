"""Which checkpoint a run resumes from, checked before anything loads: ``train.resume_from`` (a
directory, or ``latest``: the newest checkpoint of this configuration under the outputs tree)
against the checkpoint's recorded configuration (:mod:`memlab.trainer.config_record`) and its
kind of state (:func:`memlab.trainer.checkpoint.state_format`). Loading it is
:func:`memlab.trainer.checkpoint.load`'s job.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab.registry import ConfigErrors
from memlab.trainer import config_record, inputs, integrity
from memlab.trainer.checkpoint import (
    CheckpointError,
    file_problems,
    format_problem,
    read_state,
    state_format,
)

if TYPE_CHECKING:
    from memlab.context import BuildContext


@dataclass
class ResumePlan:
    """Where a run resumes from and what it changes (``summary.json``'s ``resume``)."""

    path: Path
    requested: str
    step: int
    changed: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    """``latest``: newer checkpoints left out because they are damaged (``checkpoint``,
    ``why``)."""
    verified: bool = True
    """Whether its files were checked against the sha256 recorded when it was written (False:
    a checkpoint from a memlab that recorded none)."""

    def as_dict(self) -> dict[str, Any]:
        out = {"from": str(self.path), "requested": self.requested, "step": self.step,
               "changed": self.changed, "verified": self.verified}
        if self.skipped:
            out["skipped"] = self.skipped
        return out


def search_roots(ctx: BuildContext, roots: list[Path] | None) -> list[Path]:
    """Where ``resume_from=latest`` looks: ``train.resume_root``, else ``roots`` (the caller's
    outputs tree), else the run dir's parent."""
    if ctx.train.resume_root:
        return [Path(ctx.train.resume_root)]
    return list(roots) if roots else [Path(ctx.run_dir).absolute().parent]


def find(roots: list[Path]) -> tuple[list[tuple[Path, dict[str, Any]]],
                                     list[tuple[Path, str, float]]]:
    """Every checkpoint directory under ``roots`` (recursively): ``(those whose state reads,
    with it, newest first; those whose state does not, with why and when they were written)``.
    """
    seen: set[Path] = set()
    out, unreadable = [], []
    for root in roots:
        if not root.is_dir():
            continue
        for d in root.rglob("checkpoints/step_*"):
            d = d.resolve()
            if d in seen or not d.is_dir():
                continue
            seen.add(d)
            try:
                out.append((d, read_state(d)))
            except CheckpointError as e:
                unreadable.append((d, str(e), d.stat().st_mtime))
    out.sort(key=lambda x: (x[1].get("saved_at", 0.0), x[1].get("step", 0)), reverse=True)
    return out, unreadable


def input_differences(state: dict[str, Any], ctx: BuildContext) -> list[config_record.Difference]:
    """The run's inputs (data, model, tokenizer, chat template) that differ from the
    fingerprints the checkpoint recorded (:mod:`memlab.trainer.inputs`), as ``inputs.<name>``
    differences (the checkpoint's and this run's files, in words)."""
    recorded = state.get("inputs") or {}
    now = inputs.of_run(ctx)
    out = []
    for name in sorted(recorded):
        differs, current = inputs.changed(recorded[name], now.get(name, inputs.Inputs()))
        if differs:
            was, is_now = inputs.describe(recorded[name], current)
            out.append(config_record.Difference(f"inputs.{name}", was, is_now))
    return out


def plan_resume(ctx: BuildContext, roots: list[Path] | None = None,
                live: Callable[[Path], str | None] | None = None) -> ResumePlan | None:
    """Check ``train.resume_from`` against the checkpoint before anything loads: the
    checkpoint exists, is memlab's and whole (:func:`memlab.trainer.checkpoint.file_problems`),
    its kind of state suits this run, its configuration and its inputs (data, model, tokenizer,
    chat template: :mod:`memlab.trainer.inputs`) differ from this run's only in what
    ``train.resume_allow`` names, and it is short of ``train.steps``. Its files must match the
    sha256 each had when written (a damaged checkpoint is refused whatever
    ``train.resume_allow`` says); a checkpoint that recorded no hashes resumes with a warning
    that it cannot be verified. Versions of torch / transformers / peft / memlab that differ
    from the checkpoint's are recorded in ``changed`` (``versions.<package>``), not refused. ``latest``: the newest
    such checkpoint under :func:`search_roots` (newer damaged ones are skipped and named, and
    so are those of a run that is still running: ``live(run dir)`` says who runs there, or
    None; that run would prune the checkpoint it is still writing beside).
    Raises ConfigErrors (one message listing every difference) otherwise."""
    where = ctx.train.resume_from
    if not where:
        return None
    allow = list(ctx.train.resume_allow)
    new = config_record.record(ctx)
    base = config_record.defaults(ctx)
    want = state_format(ctx.distributed)

    def differences(state: dict[str, Any]) -> list[config_record.Difference]:
        return (config_record.differences(state.get("config") or {}, new, base)
                + input_differences(state, ctx))

    def refused(state: dict[str, Any]) -> list[config_record.Difference]:
        return [d for d in differences(state) if not config_record.matches(d.key, allow)]

    skipped: list[dict[str, str]] = []
    if where == "latest":
        roots = search_roots(ctx, roots)
        found, unreadable = find(roots)
        match = None
        for p, s in found:
            if refused(s) or format_problem(p, s, want) is not None:
                continue
            running = live(p.parent.parent) if live is not None else None
            if running:
                skipped.append({"checkpoint": str(p), "why": f"its run is still running "
                                                             f"({running})"})
                continue
            damaged = file_problems(p, s)
            if damaged:
                skipped.append({"checkpoint": str(p), "why": "; ".join(damaged)})
                continue
            match = (p, s)
            break
        newest = match[1].get("saved_at", 0.0) if match is not None else 0.0
        skipped += [{"checkpoint": str(p), "why": why} for p, why, when in
                    sorted(unreadable, key=lambda x: -x[2]) if when > newest]
        if match is None:
            msg = (f"train.resume_from=latest: no checkpoint of this configuration under "
                   f"{', '.join(map(str, roots))}")
            others = [(p, s) for p, s in found if str(p) not in {k["checkpoint"]
                                                                  for k in skipped}]
            if others:
                p, s = others[0]
                diffs = refused(s)
                msg += (f" ({len(others)} of other configurations; the newest, {p}, differs "
                        "in: " + "; ".join(d.line() for d in diffs[:8])
                        + ("; ..." if len(diffs) > 8 else "")
                        + (f"; {format_problem(p, s, want)}" if format_problem(p, s, want)
                           else "") + ")")
            if skipped:
                msg += " (skipped as damaged: " + "; ".join(
                    f"{k['checkpoint']}: {k['why']}" for k in skipped) + ")"
            msg += ("; start without train.resume_from, name a checkpoint directory, set "
                    "train.resume_root, or list the settings you mean to change in "
                    "train.resume_allow")
            raise ConfigErrors([msg])
        path, state = match
    else:
        path = Path(where).expanduser()
        try:
            state = read_state(path)
        except CheckpointError as e:
            raise ConfigErrors([f"train.resume_from={where}: {e}"]) from None
        errors = [f"train.resume_from={where}: {p}" for p in file_problems(path, state)]
        problem = format_problem(path, state, want)
        if problem:
            errors.append(problem)
        diffs = refused(state)
        if diffs:
            errors.append(config_record.refusal(where, diffs))
        if errors:
            raise ConfigErrors(errors)
    step = int(state["step"])
    steps = ctx.train.fixed_steps()  # (train.epochs: counted on the rows; the loop stops there)
    if steps is not None and step >= steps:
        raise ConfigErrors([
            f"train.resume_from={where}: {path} is at step {step}, and train.steps="
            f"{steps}: that training is already complete (its record: "
            f"{path.parent.parent / 'summary.json'}); nothing is left to train. To train "
            f"further, raise train.steps and allow the change: train.steps=<more than {step}> "
            "train.resume_allow='[train.steps]'"])
    changed = {d.key: {"checkpoint": d.checkpoint, "run": d.run} for d in differences(state)}
    changed.update(integrity.version_changes(state))
    verified = integrity.verifiable(state)
    if not verified and ctx.rank == 0:
        print(f"[memlab] warning: train.resume_from: {path} records no sha256 of its files "
              "(written by a memlab before checkpoints recorded them): they cannot be "
              "verified; resuming it as it is", file=sys.stderr, flush=True)
    return ResumePlan(path=path.absolute(), requested=where, step=step, changed=changed,
                      skipped=skipped, verified=verified)
