"""A rank for tests/integration/test_launch.py (``python -m launch_probe RUN_DIR``): joins the
process group through the environment the launcher gave it (``env://``), sums the ranks with
an all-reduce, and records what it saw as ``ranks/rank<r>.json``. ``PROBE_FAIL=<r>``: rank r
raises instead (an exception that escapes, for the error file) and the others only record.
``PROBE_HANG=<r>``: rank r ignores SIGTERM and sleeps (a rank that stopped responding) and
the others record ``failed``."""

import json
import os
import signal
import sys
import time
from pathlib import Path

LOADED_AT_START = sorted(m for m in sys.modules if m.split(".")[0] in
                         {"transformers", "peft", "datasets", "memlab", "hydra_plugins"})
"""What this rank had imported before its own first line: a rank forked from the preloading
server (:data:`memlab.distributed.starter.PRELOAD`) starts with it."""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402


@record
def main(run_dir: Path) -> int:
    rank = int(os.environ["RANK"])
    total = torch.tensor([float(rank)])
    if os.environ.get("PROBE_FAIL") == str(rank):
        raise ValueError(f"probe rank {rank} fails on purpose")
    if os.environ.get("PROBE_HANG") == str(rank):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    if os.environ.get("PROBE_HANG"):
        out = run_dir / "ranks" / f"rank{rank}.json"
        out.write_text(json.dumps({"status": "failed", "error": "waited for the hung rank"}))
        return 1
    if not os.environ.get("PROBE_FAIL"):  # with a failing rank, the others skip the group
        dist.init_process_group("gloo")
        dist.all_reduce(total)
        dist.destroy_process_group()
    print(f"probe rank {rank} stdout", flush=True)
    print(f"probe rank {rank} stderr", file=sys.stderr, flush=True)
    seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                           "MEMLAB_RANK", "TORCHELASTIC_ERROR_FILE")}
    out = run_dir / "ranks" / f"rank{rank}.json"
    out.write_text(json.dumps({"status": "ok", "error": None, "env": seen, "cwd": os.getcwd(),
                               "extra": os.environ.get("PROBE_EXTRA"),
                               "tokenizers": os.environ.get("TOKENIZERS_PARALLELISM"),
                               "sum": total.item(), "data": {"tokens_trained": 1},
                               "loaded_at_start": LOADED_AT_START}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
