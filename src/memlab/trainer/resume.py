"""Which checkpoint a run resumes from, checked before anything loads: ``train.resume_from`` (a
directory, or ``latest``: the newest checkpoint of this configuration under the outputs tree)
against the checkpoint's recorded configuration (:mod:`memlab.trainer.config_record`) and its
kind of state (:func:`memlab.trainer.checkpoint.state_format`). Loading it is
:func:`memlab.trainer.checkpoint.load`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab.registry import ConfigErrors
from memlab.trainer import config_record
from memlab.trainer.checkpoint import (
    STATE,
    CheckpointError,
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

    def as_dict(self) -> dict[str, Any]:
        return {"from": str(self.path), "requested": self.requested, "step": self.step,
                "changed": self.changed}


def search_roots(ctx: BuildContext, roots: list[Path] | None) -> list[Path]:
    """Where ``resume_from=latest`` looks: ``train.resume_root``, else ``roots`` (the caller's
    outputs tree), else the run dir's parent."""
    if ctx.train.resume_root:
        return [Path(ctx.train.resume_root)]
    return list(roots) if roots else [Path(ctx.run_dir).absolute().parent]


def find(roots: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """Every complete checkpoint under ``roots`` (recursively) with its state, newest first."""
    seen: set[Path] = set()
    out = []
    for root in roots:
        if not root.is_dir():
            continue
        for file in root.rglob(f"checkpoints/step_*/{STATE}"):
            d = file.parent.resolve()
            if d in seen:
                continue
            seen.add(d)
            try:
                out.append((d, read_state(d)))
            except CheckpointError:
                continue
    out.sort(key=lambda x: (x[1].get("saved_at", 0.0), x[1].get("step", 0)), reverse=True)
    return out


def plan_resume(ctx: BuildContext, roots: list[Path] | None = None) -> ResumePlan | None:
    """Check ``train.resume_from`` against the checkpoint before anything loads: the
    checkpoint exists and is memlab's, its kind of state suits this run, and its configuration
    differs from this run's only in the settings ``train.resume_allow`` names. ``latest``: the
    newest such checkpoint under :func:`search_roots`. Raises ConfigErrors (one message listing
    every difference) otherwise."""
    where = ctx.train.resume_from
    if not where:
        return None
    allow = list(ctx.train.resume_allow)
    new = config_record.record(ctx)
    base = config_record.defaults(ctx)
    want = state_format(ctx.distributed)

    def refused(state: dict[str, Any]) -> list[config_record.Difference]:
        diffs = config_record.differences(state.get("config") or {}, new, base)
        return [d for d in diffs if not config_record.matches(d.key, allow)]

    if where == "latest":
        roots = search_roots(ctx, roots)
        found = find(roots)
        match = next(((p, s) for p, s in found
                      if not refused(s) and format_problem(p, s, want) is None), None)
        if match is None:
            msg = (f"train.resume_from=latest: no checkpoint of this configuration under "
                   f"{', '.join(map(str, roots))}")
            if found:
                p, s = found[0]
                diffs = refused(s)
                msg += (f" ({len(found)} of other configurations; the newest, {p}, differs in: "
                        + "; ".join(d.line() for d in diffs[:8])
                        + ("; ..." if len(diffs) > 8 else "")
                        + (f"; {format_problem(p, s, want)}" if format_problem(p, s, want)
                           else "") + ")")
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
        errors = []
        problem = format_problem(path, state, want)
        if problem:
            errors.append(problem)
        diffs = refused(state)
        if diffs:
            errors.append(config_record.refusal(where, diffs))
        if errors:
            raise ConfigErrors(errors)
    changed = {d.key: {"checkpoint": d.checkpoint, "run": d.run}
               for d in config_record.differences(state.get("config") or {}, new, base)}
    return ResumePlan(path=path.absolute(), requested=where, step=int(state["step"]),
                      changed=changed)
