"""One rank of a torchrun launch (e.g. across nodes: ``torchrun --nnodes 2 --nproc_per_node 8
... -m memlab distributed=fsdp2``): every process is a rank already (memlab starts none). The
ranks meet in rank 0's run dir, each records its own ``ranks/rank<r>.json``, and rank 0 merges
them into ``summary.json`` (:func:`memlab.distributed.launch.merge`, as for ranks memlab starts
itself).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from memlab import faults
from memlab.context import BuildContext, plain_config, resolved_options, validate
from memlab.distributed import launch
from memlab.logger.base import RunInfo
from memlab.measure import runlog
from memlab.measure.console import printable
from memlab.measure.summary import format_table
from memlab.record import exit_code, guarded
from memlab.registry import ConfigErrors
from memlab.run import base_summary, execute, late_logger, plan_resume, sweep_dir

RANK0_GRACE_S = 60.0


def wait_for_rank0(summary: dict[str, Any], grace_s: float = RANK0_GRACE_S) -> None:
    """A rank other than 0 whose check failed leaves the exit to rank 0, which records the
    problems: torchrun stops every rank as soon as one exits, so a rank that left first would
    stop rank 0 while it still checks (its record would read ``interrupted``, seen once under
    load). Rank 0 finds the same problems and exits; torchrun's SIGTERM then ends this wait.
    After ``grace_s`` (a failure of this rank alone) the rank exits on its own."""
    print(f"[memlab] rank {os.environ.get('RANK')}: {summary['status']}: "
          f"{summary.get('error')}; rank 0 records it", file=sys.stderr, flush=True)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        time.sleep(0.1)


def run_rank(cfg: Any, run_dir: Path, choices: dict[str, str] | None = None,
             overrides: list[str] | None = None, job: dict[str, Any] | None = None,
             print_table: bool = True) -> dict[str, Any]:
    """This process's rank of the torchrun launch (module docstring). Once the process group is
    up, rank 0 tells the others its run dir (each rank's Hydra resolves ``${now:}`` itself, so
    their own dirs may differ), every rank writes its ``ranks/rank<r>.json`` there, and rank 0
    merges them into ``summary.json``. A failing rank exits at once with status 1, so torchrun
    stops the others. Returns the merged summary on rank 0 and this rank's summary elsewhere."""
    import torch.distributed as dist

    from memlab.distributed.base import env_rank

    choices, overrides, job = dict(choices or {}), list(overrides or []), job or {}
    rank, _, world = env_rank()
    summary = base_summary(run_dir, choices, overrides, job)
    holder: list[BuildContext] = []

    def check(_: list) -> None:
        faults.reach(f"check:rank{rank}")
        ctx = validate(cfg, run_dir, choices, world_size=world, rank=rank)
        if ctx.distributed.as_ranks() is None:
            raise ConfigErrors([f"started by an external launcher with WORLD_SIZE={world}, "
                                f"but distributed={ctx.distributed.name} runs one process; use "
                                "distributed=ddp or distributed=fsdp2"])
        if job.get("num") is not None:
            raise ConfigErrors(["a Hydra sweep (-m) under torchrun would start every job in "
                                "every rank; run the sweep without torchrun: memlab starts the "
                                "ranks of each job itself (distributed.nproc)"])
        summary["config"] = plain_config(cfg)
        summary["resolved"] = resolved_options(summary["config"], ctx)
        holder.append(plan_resume(ctx, summary))

    scratch = run_dir / f".rank{rank}.check.json"
    info = RunInfo(run_dir, choices, sweep_dir(job))
    guarded(check, summary, run_dir / "summary.json" if rank == 0 else scratch,
            on_end=(lambda s, box: late_logger(cfg, info, s, box)) if rank == 0 else None)
    scratch.unlink(missing_ok=True)  # every rank finds the same problems; rank 0 records them
    if not holder:
        if rank:
            wait_for_rank0(summary)
        return summary
    ctx = holder[0]
    ctx.distributed.setup(ctx)
    shared = [str(Path(run_dir).resolve())]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])
    ctx = dataclasses.replace(ctx, run_dir=root)
    mine = base_summary(root, choices, overrides, job)
    mine["rank"] = rank
    guarded(lambda box: execute(ctx, mine, box), mine, root / "ranks" / f"rank{rank}.json")
    if mine["status"] != "ok":
        ctx.distributed.teardown()
        # torchrun stops the other ranks
        raise SystemExit(exit_code(mine) if mine["status"] == "interrupted" else 1)
    dist.barrier()
    if rank == 0:
        summary.update(run_dir=str(root))
        guarded(lambda _: launch.merge(summary, root / "ranks", world, [0] * world), summary,
                root / "summary.json")
        if print_table:
            runlog.say(printable(format_table(summary), keep_newlines=True))
    ctx.distributed.teardown()
    if rank and Path(run_dir).resolve() != root:
        own = Path(run_dir)
        if own.is_dir() and all(p.name == ".hydra" or p.suffix == ".log"
                                for p in own.iterdir()):
            shutil.rmtree(own, ignore_errors=True)  # this rank's empty Hydra dir
        return mine
    return summary if rank == 0 else mine
