"""Checkpoints of a training run: a Hugging Face directory of the policy plus everything resuming
needs, written without pickles and read without running code.

``run_dir/checkpoints/step_<n>/`` holds

- the Hugging Face directory (:mod:`memlab.trainer.export`): the model or the PEFT adapter, the
  tokenizer, optionally ``merged/``;
- ``memlab_state.json``: step, the configuration the checkpoint was made with
  (:mod:`memlab.trainer.config_record`), schedule, loss scaler, data position, loss curve and
  the non-tensor parts of the optimizer state and random states, as plain JSON;
- ``memlab_state.safetensors`` (random generator states), ``optimizer.safetensors`` (optimizer
  state) and ``trainable.safetensors`` (trainable weights the Hugging Face files do not already
  hold under their own names: adapters, a PPO value model);
- ``deepspeed/``: DeepSpeed's own shards (``distributed=deepspeed``). DeepSpeed reads them with
  pickle, so every file is first opened with ``torch.load(weights_only=True)`` (DeepSpeed's two
  plain-data classes allowed): a file that would run code is refused before DeepSpeed sees it.

``memlab_state.json`` also records the sha256 of every file and the versions of torch,
transformers, peft and memlab; resume verifies the files and that the tensors it loads are
finite (:mod:`memlab.trainer.integrity`).

Three kinds of state, by what the distributed option declares (:func:`state_format`):
``torch`` (one replica's state: single process, DDP), ``by_name`` (gathered from FSDP2's shards
by parameter name, ``as_gathered_states()``: a collective, written by rank 0, re-sharded on
load), ``native`` (DeepSpeed's shards, ``as_native_states()``). A checkpoint is written to a
temporary directory and renamed when complete; a write that fails (a full or unwritable disk)
leaves no partial directory behind, and its error is recognised whichever library raised it
(:func:`is_write_failure`). ``train.keep_last`` prunes only the checkpoints the run itself wrote
(a run dir used again keeps an earlier run's).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch
from torch import nn

from memlab.trainer import config_record, export, inputs, integrity
from memlab.trainer.integrity import check_pickles
from memlab.trainer.routing import unwrap
from memlab.trainer.state_files import (
    CheckpointError,
    from_tree,
    load_tensors,
    save_tensors,
    to_tree,
)

if TYPE_CHECKING:
    from memlab.protocols import BuildContext, Distributed
    from memlab.trainer.batch import BatchStream
    from memlab.trainer.evaluate import Evaluator

class _Record(Protocol):
    losses: list[float]
    curves: dict[str, list[float]]
    counts: dict[str, int]
    checkpoints: list[str]


class Checkpointed(Protocol):
    """What :func:`save` writes of a trainer and :func:`load` restores into it: a
    :class:`memlab.trainer.loop.Trainer` (which imports this module: named by what is read)."""

    ctx: BuildContext
    dist: Distributed
    policy: nn.Module
    models: dict[str, nn.Module]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    stream: BatchStream
    evaluator: Evaluator | None
    step_idx: int

    @property
    def result(self) -> _Record: ...  # a TrainResult
    def best_checkpoint(self) -> Path | None: ...


KINDS = {"torch": "a replicated run (single or ddp)", "by_name": "a sharded run (distributed=fsdp2)",
         "native": "distributed=deepspeed"}
STATE = "memlab_state.json"
STATE_TENSORS = "memlab_state.safetensors"
OPTIMIZER = "optimizer.safetensors"
TRAINABLE = "trainable.safetensors"
FORMAT, VERSION = "memlab-checkpoint", 1

StateFormat = Literal["torch", "by_name", "native"]


def state_format(dist: Distributed) -> StateFormat:
    """How the run's distributed option checkpoints its training state (module docstring)."""
    if dist.as_native_states() is not None:
        return "native"
    if dist.as_gathered_states() is not None:
        return "by_name"
    return "torch"


_OS_ERROR = re.compile(r"\(os error \d+\)")
"""How Rust's ``std::io::Error`` ends its message (``No space left on device (os error 28)``)."""


def is_write_failure(e: BaseException) -> bool:
    """Whether ``e`` says that a file could not be written (a full, unwritable or missing
    disk), whichever library raised it: Python's OSError, or the errors of the Rust writers a
    checkpoint goes through, which are no OSError (safetensors' ``SafetensorError: Error while
    serializing: I/O error: ... (os error 28)``, tokenizers' bare ``Exception: ... (os error
    28)``). Causes count too (a library that wraps the OSError it got)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) or (isinstance(cur, Exception)
                                        and _OS_ERROR.search(str(cur))):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


# ----------------------------------------------------------------------------- helpers
def named_trainable(models: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
    """Trainable parameters by name: the policy's as named in the unwrapped model, other
    models' prefixed with their role (``value::...``)."""
    out: dict[str, nn.Parameter] = {}
    for role, m in models.items():
        prefix = "" if role == "policy" else f"{role}::"
        for n, p in unwrap(m).named_parameters():
            if p.requires_grad:
                out.setdefault(prefix + n, p)
    return out


def step_dirs(root: Path) -> list[Path]:
    """The complete checkpoints directly in ``root`` (a run's ``checkpoints/``), oldest first."""
    found = [p for p in root.glob("step_*") if (p / STATE).is_file()]
    return sorted(found, key=lambda p: p.name)


def read_state(path: Path | str) -> dict[str, Any]:
    """``memlab_state.json`` of checkpoint ``path``, checked to be one (CheckpointError naming
    what is wrong otherwise). Reads JSON only."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    file = path / STATE
    if not file.is_file():
        if (path / "state.pt").is_file():
            raise CheckpointError(
                f"{path} holds a pickled state.pt (memlab before checkpoints became safetensors "
                "+ JSON); memlab does not unpickle checkpoints, so it is not loaded. Retrain, or "
                "start a new run from its weights")
        raise CheckpointError(f"{path} is not a memlab checkpoint (no {STATE}); give a "
                              "run_dir/checkpoints/step_<n> directory")
    try:
        state = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the checkpoint is damaged") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a memlab checkpoint state")
    if state.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} was written by a newer memlab (format version "
                              f"{state['version']}); upgrade memlab to resume it")
    return state


def _refs(tree: Any, out: set[str]) -> set[str]:
    """The tensor keys a :func:`to_tree` tree refers to."""
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            out.add(str(tree["__tensor__"]))
        for v in tree.values():
            _refs(v, out)
    elif isinstance(tree, list):
        for v in tree:
            _refs(v, out)
    return out


def _tensor_file_problem(file: Path) -> tuple[set[str] | None, str | None]:
    """``(the tensor names of a safetensors file, None)``, or ``(None, what is wrong)``: its
    header is read, and checked to cover the whole file (a truncated file fails here)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return set(f.keys()), None
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file, whatever the library says
        return None, (f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); "
                      "it is damaged (truncated?) or not memlab's")


def file_problems(path: Path | str, state: dict[str, Any]) -> list[str]:
    """Every file of checkpoint ``path`` that its ``memlab_state.json`` (``state``) needs and
    that is missing or damaged, each named with what is wrong: the optimizer state, the random
    and schedule state, the weights (their headers and the tensors the state refers to are
    read), and every file's content against the sha256 recorded when it was written
    (:func:`memlab.trainer.integrity.hash_problems`: the files are read whole, once a
    process). Empty for a whole checkpoint."""
    path = Path(path)
    problems = []
    named: set[Path] = set()  # files with a problem said: no second one about their hash
    need = {STATE_TENSORS: _refs([state.get("scheduler"), state.get("scaler"),
                                  state.get("rng")], set())}
    if state.get("optimizer") is not None:
        need[OPTIMIZER] = _refs(state["optimizer"], set())
    whole = "copy the whole step directory, or resume from another checkpoint"
    for name, keys in need.items():
        file = path / name
        if not file.is_file():
            named.add(file)
            if keys:
                what = "optimizer" if name == OPTIMIZER else "random and schedule"
                problems.append(f"{file} is missing: {STATE} refers to {len(keys)} tensor(s) "
                                f"in it (the {what} state); the checkpoint is incomplete: "
                                f"{whole}")
            continue
        found, problem = _tensor_file_problem(file)
        if problem:
            problems.append(problem)
            named.add(file)
        elif found is not None and keys - found:
            gone = sorted(keys - found)
            problems.append(f"{file} lacks {len(gone)} tensor(s) {STATE} refers to (e.g. "
                            f"{gone[0]!r}); it is not this checkpoint's: {whole}")
    for file in sorted(path.glob("*.safetensors")):
        if file.name not in need and (problem := _tensor_file_problem(file)[1]):
            problems.append(problem)
            named.add(file)
    if state.get("weights_in_model") and not (
            (path / "model.safetensors").is_file()
            or (path / "model.safetensors.index.json").is_file()):
        named.add(path / "model.safetensors")
        problems.append(f"{path / 'model.safetensors'} is missing: {STATE} reads "
                        f"{len(state['weights_in_model'])} trainable weight(s) from the saved "
                        f"model; the checkpoint is incomplete: {whole}")
    if state.get("optimizer_format") == "native" and not (path / "deepspeed").is_dir():
        named.add(path / "deepspeed")
        problems.append(f"{path / 'deepspeed'} is missing: DeepSpeed's shards of the training "
                        f"state; the checkpoint is incomplete: {whole}")
    return problems + integrity.hash_problems(path, state, STATE, named)


def read_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """The trainable weights checkpoint ``path`` holds, by name (as :func:`named_trainable`
    names them): ``trainable.safetensors`` plus those the saved model files hold; each checked
    to be finite (CheckpointError naming file and tensor otherwise)."""
    path = Path(path)
    state = read_state(path)
    weights = _finite(load_tensors(path / TRAINABLE), path / TRAINABLE)
    in_model = state.get("weights_in_model") or []
    if in_model:
        index = path / "model.safetensors.index.json"
        where = index if index.is_file() else path / "model.safetensors"
        weights.update(_finite(export.read_model_weights(path, set(in_model)), where))
    return weights


def _finite(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """``tensors`` (read from ``file``), when every one is finite; CheckpointError otherwise."""
    problem = integrity.nonfinite(tensors, file)
    if problem:
        raise CheckpointError(problem)
    return tensors


# ------------------------------------------------------------------------------- saving
def save(trainer: Checkpointed) -> Path:
    """Write ``run_dir/checkpoints/step_<n>`` (atomically: a temp dir renamed); every rank calls
    it (gathering may be a collective), rank 0 writes the files. Whatever stops the write (a
    full disk, a stop signal), the partial temp dir is removed. The checkpoint joins
    ``trainer.result.checkpoints`` (this run's), which ``train.keep_last`` prunes."""
    ctx = trainer.ctx
    root = Path(ctx.run_dir) / "checkpoints"
    final = step_dir(Path(ctx.run_dir), trainer.step_idx)
    tmp = root / f".tmp_step_{trainer.step_idx:06d}"
    try:
        _write(trainer, tmp, final)
    except BaseException:
        if ctx.rank == 0:
            _remove(tmp)
        raise
    own = trainer.result.checkpoints
    if str(final) in own:  # written again (a resumed step): the newest now
        own.remove(str(final))
    own.append(str(final))
    if ctx.rank == 0 and ctx.train.keep_last:
        best = trainer.best_checkpoint()
        pruned = prune([Path(p) for p in own], ctx.train.keep_last,
                       keep=[best] if best is not None else [])
        own[:] = [p for p in own if Path(p) not in pruned]
    return final


def _remove(path: Path) -> None:
    """Remove a directory of memlab's (a link there: the link itself, never what it names)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _write(trainer: Checkpointed, tmp: Path, final: Path) -> None:
    """The files of one checkpoint, into ``tmp``, renamed to ``final`` when complete."""
    ctx, dist = trainer.ctx, trainer.dist
    fmt = state_format(dist)
    native, gathered = dist.as_native_states(), dist.as_gathered_states()
    weights: dict[str, torch.Tensor] | None = None
    optim: dict[str, Any] | None = None
    written: dict[str, str] = {}  # sha256 by relative path, of the files hashed as written
    if native is not None:  # every rank writes its own shards, then meets
        if ctx.rank == 0:
            _remove(tmp)
        if ctx.world_size > 1:
            torch.distributed.barrier()
        written.update(native.save_states(trainer.policy, tmp))  # (rank 0: every rank's)
        weights = native.full_weights(trainer.policy)
        if ctx.world_size > 1:
            torch.distributed.barrier()
    elif gathered is not None:  # gathered by every rank (a collective), written by rank 0
        weights, optim = gathered.full_state(trainer.policy, trainer.opt)
    if ctx.rank != 0:
        return
    if fmt != "native":
        _remove(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    exported = export.write(ctx, unwrap(trainer.policy), weights, tmp)
    in_model = export.weight_names(tmp) if exported["kind"] == "model" else set()
    if fmt == "torch":
        trainable: dict[str, torch.Tensor] = dict(named_trainable(trainer.models))
        optim = trainer.opt.state_dict()
    else:
        trainable = dict(weights or {})
    covered = sorted(n for n in trainable if n in in_model)  # read back from the model files
    rest = {n: t for n, t in trainable.items() if n not in in_model}
    if rest:
        written[TRAINABLE] = save_tensors(tmp / TRAINABLE, rest)
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "step": trainer.step_idx,
        "versions": integrity.versions(),
        "saved_at": time.time(),
        "optimizer_format": fmt,
        "config": config_record.record(ctx),
        "inputs": inputs.record(inputs.of_run(ctx)),
        "export": exported,
        "weights_in_model": covered,
        "scheduler": to_tree(trainer.sched.state_dict(), tensors, "scheduler"),
        "scaler": to_tree(trainer.scaler.state_dict() if trainer.scaler else None, tensors,
                          "scaler"),
        "stream": trainer.stream.state(),
        "losses": list(trainer.result.losses),
        "curves": trainer.result.curves,
        "counts": trainer.result.counts,
        "eval": trainer.evaluator.state.state() if trainer.evaluator is not None else None,
        "rng": to_tree({"torch": torch.get_rng_state(), "python": random.getstate(),
                        "numpy": np.random.get_state(),
                        "cuda": (torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                                 else None)}, tensors, "rng"),
    }
    if optim is not None:
        opt_tensors: dict[str, torch.Tensor] = {}
        state["optimizer"] = to_tree(optim, opt_tensors, "optimizer")
        written[OPTIMIZER] = save_tensors(tmp / OPTIMIZER, opt_tensors)
    written[STATE_TENSORS] = save_tensors(tmp / STATE_TENSORS, tensors)
    state["files"] = integrity.file_hashes(tmp, written, skip=STATE)
    state["state_sha256"] = integrity.state_digest(state)
    (tmp / STATE).write_text(json.dumps(state, indent=1) + "\n")
    _remove(final)
    tmp.rename(final)


def step_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes (``run_dir/checkpoints/step_<n>``)."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def prune(own: Sequence[Path], newest: int, keep: Sequence[Path] = ()) -> list[Path]:
    """Delete all but the ``newest`` of ``own`` (the checkpoints this run wrote, oldest first)
    and those in ``keep`` (the best evaluation's, ``train.save_best``); returns the deleted
    dirs. A checkpoint another run left in the same run dir is never this run's to delete."""
    protected = {Path(p).resolve() for p in keep}
    old = [Path(p) for p in list(own)[:-newest] if Path(p).resolve() not in protected]
    for p in old:
        _remove(p)
    return old


def format_problem(path: Path, state: dict[str, Any], want: str) -> str | None:
    """Why the checkpoint at ``path`` cannot resume a run whose state is ``want``, or None."""
    fmt = state.get("optimizer_format", "torch")
    if fmt == want:
        return None
    return (f"checkpoint {path} was written by {KINDS.get(fmt, fmt)}; resume it with the same "
            f"kind of setup (this run is {KINDS.get(want, want)})")


def resolve(run_dir: Path | str, where: str) -> Path:
    """``train.resume_from`` as a directory (``latest``: the newest checkpoint of this run dir;
    a run resolves ``latest`` across the outputs tree first, see
    :func:`memlab.trainer.resume.plan_resume`)."""
    if where == "latest":
        found = step_dirs(Path(run_dir) / "checkpoints")
        if not found:
            raise FileNotFoundError("train.resume_from=latest: no checkpoint under "
                                    f"{run_dir}/checkpoints")
        return found[-1]
    return Path(where)


def _apply_hyperparameters(trainer: Any) -> None:
    """The optimizer's and schedule's settings from this run's config (loading a state dict
    restores the checkpoint's; an allowed change of ``train.lr`` / ``weight_decay`` or of the
    optimizer's knobs, ``optimizer.betas``..., takes effect here). Unchanged settings give back
    exactly the loaded values."""
    cfg, opt, sched = trainer.ctx.train, trainer.opt, trainer.sched
    settings = trainer.ctx.optimizer.group_settings()
    sched.base_lrs = [cfg.lr for _ in opt.param_groups]
    for i, g in enumerate(opt.param_groups):
        g["initial_lr"] = cfg.lr
        g["lr"] = cfg.lr * sched.lr_lambdas[i](sched.last_epoch)
        if "weight_decay" in g:
            g["weight_decay"] = cfg.weight_decay
        for k, v in settings.items():
            if k in g:
                g[k] = v
    sched._last_lr = [g["lr"] for g in opt.param_groups]


def load(trainer: Checkpointed, path: Path) -> None:
    """Restore ``trainer`` from checkpoint dir ``path`` (written by :func:`save`). Reads JSON
    and safetensors only (DeepSpeed's shards after :func:`check_pickles`); the files are
    checked whole and unchanged (:func:`file_problems`, which
    :func:`memlab.trainer.resume.plan_resume` ran already: their hashes are not computed
    again) and every tensor loaded finite."""
    path = Path(path)
    dist = trainer.dist
    state = read_state(path)
    problem = format_problem(path, state, state_format(dist))
    if problem:
        raise CheckpointError(problem)
    damaged = file_problems(path, state)
    if damaged:
        raise CheckpointError("; ".join(damaged))
    native, gathered = dist.as_native_states(), dist.as_gathered_states()
    if native is not None:
        check_pickles(path / "deepspeed")
        native.load_states(trainer.policy, path)
    elif gathered is not None:
        optim = from_tree(state["optimizer"], _finite(load_tensors(path / OPTIMIZER),
                                                      path / OPTIMIZER))
        gathered.load_full_state(trainer.policy, trainer.opt, read_weights(path), optim)
    else:
        optim = from_tree(state["optimizer"], _finite(load_tensors(path / OPTIMIZER),
                                                      path / OPTIMIZER))
        weights = read_weights(path)
        named = named_trainable(trainer.models)
        missing = sorted(set(named) - set(weights))
        if missing:
            raise CheckpointError(f"{path} holds no weights for {len(missing)} trainable "
                                  f"parameter(s) of this run (e.g. {missing[0]}); was it made "
                                  "with another model or peft setting?")
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(weights[n].to(p.device, p.dtype))
        trainer.opt.load_state_dict(optim)
    tensors = _finite(load_tensors(path / STATE_TENSORS), path / STATE_TENSORS)
    trainer.sched.load_state_dict(from_tree(state["scheduler"], tensors))
    _apply_hyperparameters(trainer)
    scaler = from_tree(state["scaler"], tensors)
    if trainer.scaler and scaler:
        trainer.scaler.load_state_dict(scaler)
    trainer.stream.load_state(state["stream"])
    trainer.step_idx = int(state["step"])
    trainer.result.losses = list(state["losses"])
    trainer.result.curves = {k: list(v) for k, v in (state.get("curves") or {}).items()}
    trainer.result.counts = {k: int(v) for k, v in (state.get("counts") or {}).items()}
    if trainer.evaluator is not None and state.get("eval"):
        trainer.evaluator.state.load_state(state["eval"])
    rng = from_tree(state["rng"], tensors)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
