"""Resumable checkpoints of a training run (``trainer``: the
:class:`memlab.trainer.loop.Trainer` being saved or restored): trainable weights, optimizer, schedule, loss
scaler, data position, RNG states and the loss curve so far.

Three formats, by what the distributed option declares (``checkpoint_format``):

- ``torch``: one replica's state dicts (single process, DDP: every rank holds the same state;
  rank 0 writes it, every rank can load it);
- ``by_name``: the weights and optimizer state gathered from FSDP2's shards by name (a
  collective), written by rank 0, re-sharded on load;
- ``native``: the wrapper writes its own shards (DeepSpeed), plus the whole trainable weights in
  ``state.pt`` so they are readable without DeepSpeed.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memlab.trainer.routing import unwrap

KINDS = {"torch": "a replicated run (single or ddp)", "by_name": "a sharded run (distributed=fsdp2)",
         "native": "distributed=deepspeed"}


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


def save(trainer: Any) -> Path:
    """Write ``run_dir/checkpoints/step_<n>`` (atomically: a temp dir renamed); every rank calls
    it (gathering may be a collective), rank 0 writes the shared files."""
    ctx, dist = trainer.ctx, trainer.dist
    root = Path(ctx.run_dir) / "checkpoints"
    final = root / f"step_{trainer.step_idx:06d}"
    tmp = root / f".tmp_step_{trainer.step_idx:06d}"
    fmt = dist.checkpoint_format
    weights = optim = None
    if fmt == "native":  # every rank writes its own shards, then meets
        dist.save_states(trainer.policy, tmp)
        weights = dist.full_weights(trainer.policy)
        if ctx.world_size > 1:
            torch.distributed.barrier()
    elif fmt == "by_name":  # gathered by every rank (a collective), written by rank 0
        weights, optim = dist.full_state(trainer.policy, trainer.opt)
    if ctx.rank != 0:
        return final
    if fmt == "torch":
        weights = {n: p.detach().cpu() for n, p in named_trainable(trainer.models).items()}
        optim = trainer.opt.state_dict()
    tmp.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {
        "step": trainer.step_idx,
        "weights": weights,
        "optimizer": optim,
        "optimizer_format": fmt,
        "scheduler": trainer.sched.state_dict(),
        "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "stream": trainer.stream.state(),
        "losses": trainer.result.losses,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }
    torch.save(state, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def resolve(run_dir: Path | str, where: str) -> Path:
    """``train.resume_from``: a checkpoint dir, or ``latest`` under this run dir."""
    if where == "latest":
        found = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
        if not found:
            raise FileNotFoundError("train.resume_from=latest: no checkpoint under "
                                    f"{run_dir}/checkpoints")
        return found[-1]
    return Path(where)


def load(trainer: Any, path: Path) -> None:
    """Restore ``trainer`` from checkpoint dir ``path`` (written by :func:`save`)."""
    dist = trainer.dist
    state = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
    fmt, want = state.get("optimizer_format", "torch"), dist.checkpoint_format
    if fmt != want:
        raise ValueError(f"checkpoint {path} was written by {KINDS.get(fmt, fmt)}; resume "
                         f"it with the same kind of setup (this run is {KINDS[want]})")
    if fmt == "native":
        dist.load_states(trainer.policy, path)
    elif fmt == "by_name":
        dist.load_full_state(trainer.policy, trainer.opt, state["weights"], state["optimizer"])
    else:
        named = named_trainable(trainer.models)
        with torch.no_grad():
            for n, t in state["weights"].items():
                named[n].copy_(t.to(named[n].device, named[n].dtype))
        trainer.opt.load_state_dict(state["optimizer"])
    trainer.sched.load_state_dict(state["scheduler"])
    if trainer.scaler and state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.stream.load_state(state["stream"])
    trainer.step_idx = state["step"]
    trainer.result.losses = list(state["losses"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
