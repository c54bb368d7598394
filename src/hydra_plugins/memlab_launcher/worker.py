"""One sweep job in its own process: ``python -m hydra_plugins.memlab_launcher.worker JOB.pkl``.

Rebuilds the job's config, imports the task function by name and runs it through Hydra's
``run_job`` (output dir, .hydra/ files, logging, callbacks), then pickles the JobReturn. On Linux
the job gets SIGTERM when the launcher dies (killed itself, say): it records ``interrupted``
instead of running on as an orphan."""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
from typing import Any


def _stop_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(payload_path: str) -> int:
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job, setup_globals
    from hydra.types import HydraContext

    _stop_with_parent()
    setup_globals()
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    config = payload["config"]
    fn: Any = importlib.import_module(payload["module"])
    for part in payload["qualname"].split("."):
        fn = getattr(fn, part)
    fn = getattr(fn, "__wrapped__", fn)  # the task under hydra.main's wrapper
    # run_job reads only the callbacks; Hydra types config_loader as required
    ctx = HydraContext(config_loader=None, callbacks=Callbacks(config))  # type: ignore[arg-type]
    ret = run_job(hydra_context=ctx, task_function=fn, config=config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    try:
        blob = pickle.dumps(ret)
    except Exception as e:  # noqa: BLE001 - an unpicklable return value must not lose the job
        ret._return_value = RuntimeError(f"unpicklable job result: {e}")
        blob = pickle.dumps(ret)
    with open(payload["result"], "wb") as f:
        f.write(blob)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
