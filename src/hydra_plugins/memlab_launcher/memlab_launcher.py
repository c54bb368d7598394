"""``hydra/launcher=memlab``: every sweep job in a fresh Python process, one at a time by default.

Why not the basic launcher: it runs every job in one process, so allocator state, caches and
monkey-patches (Liger!) of one job leak into the next job's numbers. Why not submitit_local:
it starts all jobs of a sweep at once, so jobs that share one device measure each other.
This launcher runs ``parallel`` jobs at a time (default 1); with ``devices`` set, each running
job gets its own GPU through CUDA_VISIBLE_DEVICES (one job per GPU on a multi-GPU machine).
A job whose process dies (segfault, OS OOM killer) still leaves a summary.json saying so, and
the sweep goes on. For clusters use hydra/launcher=submitit_slurm (one job per process too).

This module is imported by Hydra at start-up: it must stay light (no torch import).
"""

import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)


@dataclass
class MemlabLauncherConf:
    _target_: str = "hydra_plugins.memlab_launcher.memlab_launcher.MemlabLauncher"
    parallel: int = 1
    """Jobs running at once. Keep 1 when jobs share a device (the default)."""
    devices: list[Any] = field(default_factory=list)
    """GPU ids handed out one per running job (CUDA_VISIBLE_DEVICES); empty = inherit."""
    python: str | None = None
    """Interpreter for the jobs; None = the one running the sweep."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every job (e.g. OMP_NUM_THREADS)."""
    timeout_min: float | None = None
    """Kill a job after this many minutes (recorded as failed); None = no limit."""


ConfigStore.instance().store(group="hydra/launcher", name="memlab", node=MemlabLauncherConf,
                             provider="memlab")


class MemlabLauncher(Launcher):
    def __init__(self, parallel: int = 1, devices: Sequence[Any] = (), python: str | None = None,
                 env: dict[str, str] | None = None, timeout_min: float | None = None) -> None:
        self.parallel = max(1, int(parallel))
        self.devices = [str(d) for d in devices]
        if self.devices and self.parallel > len(self.devices):
            self.parallel = len(self.devices)
        self.python = python or sys.executable
        self.env = dict(env or {})
        self.timeout_s = None if timeout_min is None else float(timeout_min) * 60
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def _task_ref(self) -> tuple[str, str]:
        fn = self.task_function
        module = getattr(fn, "__module__", None) or "__main__"
        if module == "__main__":
            main_mod = sys.modules.get("__main__")
            spec = getattr(main_mod, "__spec__", None)
            module = spec.name if spec is not None else "__main__"
        return module, fn.__qualname__

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"memlab launcher: {len(job_overrides)} jobs, {self.parallel} at a time, "
                 "each in a fresh process")
        module, qualname = self._task_ref()
        jobs = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            sweep_config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"{os.getpid()}_{idx}"
                sweep_config.hydra.job.num = idx
            HydraConfig.instance().set_config(sweep_config)
            subdir = str(sweep_config.hydra.sweep.subdir)
            with read_write(sweep_config.hydra.sweep):
                # pin what the job process would otherwise resolve again (``${now:}``)
                sweep_config.hydra.sweep.dir = str(sweep_dir)
                sweep_config.hydra.sweep.subdir = subdir
            job_dir = sweep_dir / subdir
            jobs.append((idx, list(overrides), sweep_config, job_dir))
        results: dict[int, JobReturn] = {}
        pending = list(jobs)
        running: list[tuple[Any, ...]] = []
        free_devices = list(self.devices)
        tmp = Path(tempfile.mkdtemp(prefix="memlab_launch_"))
        while pending or running:
            while pending and len(running) < self.parallel:
                idx, overrides, sweep_config, job_dir = pending.pop(0)
                device = free_devices.pop(0) if free_devices else None
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}"
                         + (f"  [device {device}]" if device is not None else ""))
                proc, res_path, t0 = self._start(idx, sweep_config, module, qualname, tmp,
                                                 job_dir, device)
                running.append((proc, res_path, t0, idx, overrides, sweep_config, job_dir,
                                device))
            time.sleep(0.2)
            for item in list(running):
                proc, res_path, t0, idx, overrides, sweep_config, job_dir, device = item
                if proc.poll() is None and self.timeout_s and time.time() - t0 > self.timeout_s:
                    proc.kill()
                    proc.wait()
                if proc.poll() is None:
                    continue
                running.remove(item)
                if device is not None:
                    free_devices.append(device)
                results[idx] = self._collect(proc.returncode, res_path, overrides, sweep_config,
                                             job_dir, time.time() - t0)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return [results[j[0]] for j in jobs]

    def _start(self, idx, sweep_config, module, qualname, tmp: Path, job_dir: Path, device):
        payload = tmp / f"job_{idx}.pkl"
        res_path = tmp / f"job_{idx}.result.pkl"
        with open(payload, "wb") as f:
            pickle.dump({"config": sweep_config,
                         "module": module, "qualname": qualname, "result": str(res_path)}, f)
        env = {**os.environ, **self.env}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        out = None
        if self.parallel > 1:
            job_dir.mkdir(parents=True, exist_ok=True)
            out = open(job_dir / "job.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [self.python, "-m", "hydra_plugins.memlab_launcher.worker", str(payload)],
            env=env, stdout=out, stderr=subprocess.STDOUT if out else None, cwd=os.getcwd(),
        )
        return proc, res_path, time.time()

    def _collect(self, code: int, res_path: Path, overrides, sweep_config, job_dir: Path,
                 seconds: float) -> JobReturn:
        if code == 0 and res_path.exists():
            with open(res_path, "rb") as f:
                ret = pickle.load(f)
            if isinstance(ret, JobReturn):
                return ret
        # The process died before returning: record it, keep the sweep going.
        if code < 0:
            sig = signal.Signals(-code).name
            why = f"job process killed by {sig}"
            status = "oom" if -code == signal.SIGKILL else "failed"
            if status == "oom":
                why += " (most likely the OS out-of-memory killer)"
        else:
            why, status = f"job process exited with code {code} before writing a result", \
                "failed"
        summary_path = job_dir / "summary.json"
        summary = None
        if summary_path.exists():
            import json

            try:
                summary = json.loads(summary_path.read_text())
            except ValueError:
                summary = None
        if summary is None or summary.get("status") == "ok":
            summary = {**dict.fromkeys(("memory", "throughput", "data", "train", "versions",
                                        "device", "job")),
                       "status": status, "error": why, "overrides": list(overrides),
                       "choices": _user_choices(sweep_config),
                       "run_dir": str(job_dir), "wall_time_s": seconds}
            _write_json_atomic(summary_path, summary)
        log.warning(f"job {job_dir.name}: {why}")
        ret = JobReturn(overrides=list(overrides), cfg=None, hydra_cfg=None,
                        working_dir=str(job_dir), task_name="", status=JobStatus.COMPLETED)
        ret.return_value = summary
        return ret


def _user_choices(sweep_config: DictConfig) -> dict[str, str]:
    """The job's top-level group choices (as memlab.measure.summary.user_choices: no Hydra
    groups, no unselected optional groups, no nested helper groups such as debug/data)."""
    choices = OmegaConf.to_container(sweep_config.hydra.runtime.choices) or {}
    return {str(k): str(v) for k, v in choices.items()
            if v is not None and "/" not in str(k) and "@" not in str(k)}


def _write_json_atomic(path: Path, obj: Any) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".summary.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # readable like any file the user writes (mkstemp: 0600)
    os.replace(tmp, path)
