"""One rank of a run that ``memlab.distributed.launch`` started: ``python -m memlab.rank RUN_DIR``.

Trains the job in ``RUN_DIR/ranks/job.json`` as rank ``MEMLAB_RANK`` of ``MEMLAB_WORLD_SIZE``
and writes ``RUN_DIR/ranks/rank<r>.json`` (whatever happens: the status says how it ended).
Exit status: 0 ok, 1 the rank did not finish, 128 + the signal when stopped (143: SIGTERM, what
the launcher sends; the rank records ``interrupted`` with what it measured so far).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from memlab.context import validate
from memlab.distributed.base import env_rank
from memlab.measure import runlog
from memlab.measure.outcome import Interrupted
from memlab.record import exit_code, guarded
from memlab.run import base_summary, execute


def worker(run_dir: Path) -> int:
    """Train this rank of the job in ``run_dir/ranks/job.json``; write ``rank<r>.json``."""
    rank, _, world = env_rank()
    job = json.loads((run_dir / "ranks" / "job.json").read_text())
    summary = base_summary(run_dir, job["choices"], job["overrides"], job["job"])
    summary["rank"] = rank
    if rank == 0:  # the run's log holds the training's lines (the ranks train)
        runlog.into_file(job.get("log"))
    holder: list = []

    def body(logger_box: list) -> None:
        ctx = validate(job["config"], run_dir, job["choices"], world_size=world, rank=rank)
        holder.append(ctx)
        ctx.distributed.setup(ctx)
        execute(ctx, summary, logger_box)

    try:  # a stop signal (the launcher's SIGTERM) is recorded as interrupted
        guarded(body, summary, run_dir / "ranks" / f"rank{rank}.json")
    except Interrupted as e:  # arrived while the record was written; it is complete
        return e.exit_code
    finally:
        if holder:
            holder[0].distributed.teardown()
    code = exit_code(summary)
    return code if code in (0, 1) or summary["status"] == "interrupted" else 1


def main() -> int:
    """The rank's process; an exception that escapes the record (a broken install, say) goes
    to this rank's ``TORCHELASTIC_ERROR_FILE`` (torch's ``record``) as well as to stderr."""
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(worker)(Path(sys.argv[1]))
    return 1 if code is None else code  # (record re-raises what escapes; None: it did not)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
