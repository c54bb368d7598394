"""``hydra/launcher=memlab``: every sweep job in its own Python process, one at a time by default.

Why not the basic launcher: it runs every job in one process, so allocator state, caches and
monkey-patches (Liger!) of one job leak into the next job's numbers. Why not submitit_local:
it starts all jobs of a sweep at once, so jobs that share one device measure each other.
This launcher runs ``parallel`` jobs at a time (default 1); with ``devices`` set, each running
job gets its own GPU through CUDA_VISIBLE_DEVICES (one job per GPU on a multi-GPU machine).
For clusters use hydra/launcher=submitit_slurm (one job per process too). On a machine without
CUDA, each job's process is a fork of a server that imported torch, transformers and memlab once
(``fork_server``, :mod:`memlab.distributed.starter`): a fresh process all the same, that skips
the ~3.5 s of imports a job would otherwise start with.

Every job ends with a true record in its ``summary.json`` (:mod:`memlab.measure.outcome`): a job
records its own end; what it cannot record, the launcher does. A job past ``timeout_min`` gets
SIGTERM (it records what it measured so far), SIGKILL after ``stop_grace_s``, and is
``timeout``. A job that dies of SIGKILL from outside is ``killed``, or ``oom`` when its memory
cgroup's ``oom_kill`` counter rose or the kernel log names it (the OS out-of-memory killer; the
evidence is in the error). SIGINT / SIGTERM / SIGHUP to the sweep stop it: the running jobs get
the signal and record ``interrupted`` (the same signal again kills them at once, and their
record still names the signal the sweep received), the jobs not started yet are recorded
``not_run``, the temp files are removed, and the sweep exits with 128 + the signal. Each job's
console goes to ``<job dir>/memlab.log`` (:mod:`.joblog`), and to the sweep's console when jobs
run one at a time. Every sweep ends with one line counting the jobs by status; ``memlab`` then exits 1 when a job ``failed`` or was ``killed``
(:func:`sweep_exit_status`): a crash needs a look, an oom or an invalid combination is a result.

This module is imported by Hydra at start-up: it must stay light (no torch import).
"""

import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
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

from hydra_plugins.memlab_launcher.joblog import JobLog, console_only
from memlab.distributed import starter
from memlab.measure.outcome import FAILING, STOP_SIGNALS, OomWatch, count_line, killed_status
from memlab.measure.schema import SCHEMA_VERSION
from memlab.measure.summary import RECORD_ID_ENV, read_summary, write_summary
from memlab.rundir import remove_links

log = logging.getLogger(__name__)
WORKER = "hydra_plugins.memlab_launcher.worker"
"""The module a job's process runs (``python -m WORKER JOB.pkl``)."""


@dataclass
class MemlabLauncherConf:
    _target_: str = "hydra_plugins.memlab_launcher.memlab_launcher.MemlabLauncher"
    parallel: int = 1
    """Jobs running at once. Keep 1 when jobs share a device (the default)."""
    devices: list[Any] = field(default_factory=list)
    """GPU ids handed out one per running job (CUDA_VISIBLE_DEVICES); empty = inherit."""
    python: str | None = None
    """Interpreter for the jobs (or a wrapper that execs one); None = the one running the sweep.
    A job's own config may set its own (an experiment file's ``hydra.launcher.python``: only
    the job that needs a wrapper's limits is started through it)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every job (e.g. OMP_NUM_THREADS). A job's own config may
    set its own (an experiment file's ``hydra.launcher.env``)."""
    timeout_min: float | None = None
    """Stop a job after this many minutes (status ``timeout``, with what it measured so far);
    None = no limit. A job's own config may set its own."""
    stop_grace_s: float = 30.0
    """Seconds a job stopped by a timeout or an interrupted sweep has to record itself before
    it is killed (SIGKILL)."""
    fork_server: bool = True
    """Fork each job from a server that imported torch, transformers and memlab once (CPU
    machines, the default ``python``), instead of starting a fresh interpreter that imports
    them again (~3.5 s of CPU a job). Each job is still its own process: nothing of one job
    reaches the next."""


ConfigStore.instance().store(group="hydra/launcher", name="memlab", node=MemlabLauncherConf,
                             provider="memlab")

_ENDED: list[str] = []
"""The status of every job this process's sweeps have run (for :func:`sweep_exit_status`)."""


def sweep_exit_status() -> int:
    """1 when a job of a sweep run by this process ``failed`` or was ``killed``, else 0 (also
    when no sweep ran)."""
    return 1 if any(s in FAILING for s in _ENDED) else 0


@dataclass
class _Job:
    idx: int
    overrides: list[str]
    config: DictConfig
    dir: Path
    timeout_s: float | None
    env: dict[str, str]
    python: str = sys.executable
    """The interpreter (or wrapper) the job's process is started with, where it is not forked
    (:meth:`MemlabLauncher._forks`)."""
    proc: subprocess.Popen | None = None
    result: Path | None = None
    started: float = 0.0
    device: str | None = None
    watch: OomWatch | None = None
    stopped_by: str | None = None
    """None, ``"timeout"`` or ``"interrupt"`` (the launcher sent the stop signal)."""
    stop_signal: str | None = None
    """The signal that stopped the job: the one the sweep received, or SIGTERM (timeout)."""
    stop_sent: float = 0.0
    killed: str | None = None
    """Why SIGKILL followed (a second stop signal to the sweep, or the grace period was over);
    None: it did not."""
    log: JobLog | None = None
    record_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The id the job's record carries (``$MEMLAB_RECORD_ID``): a record without it, at the
    job's path or a fallback path, is not this job's."""

    def process(self) -> subprocess.Popen:
        """The job's process (it has been started)."""
        if self.proc is None:
            raise RuntimeError(f"job #{self.idx} has not been started")
        return self.proc


class _SweepStop:
    """SIGINT / SIGTERM / SIGHUP to the sweep: remembered (``signum``, ``count``), never raised, so the
    launcher stops its jobs in order. Main thread only; previous handlers restored on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> "_SweepStop":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._saved.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1


class MemlabLauncher(Launcher):
    def __init__(self, parallel: int = 1, devices: Sequence[Any] = (), python: str | None = None,
                 env: dict[str, str] | None = None, timeout_min: float | None = None,
                 stop_grace_s: float = 30.0, fork_server: bool = True) -> None:
        self.parallel = max(1, int(parallel))
        self.devices = [str(d) for d in devices]
        if self.devices and self.parallel > len(self.devices):
            self.parallel = len(self.devices)
        self.python = python or sys.executable
        self.fork_server = bool(fork_server)
        self.env = dict(env or {})
        self.timeout_s = None if timeout_min is None else float(timeout_min) * 60
        self.grace_s = float(stop_grace_s)
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def _task_ref(self) -> tuple[str, str]:
        fn = self.task_function
        if fn is None:
            raise RuntimeError("the launcher was not set up with a task function")
        module = getattr(fn, "__module__", None) or "__main__"
        if module == "__main__":
            main_mod = sys.modules.get("__main__")
            spec = getattr(main_mod, "__spec__", None)
            module = spec.name if spec is not None else "__main__"
        return module, fn.__qualname__

    def _job_settings(self, sweep_config: DictConfig
                      ) -> tuple[float | None, dict[str, str], str]:
        """This job's time limit, environment and interpreter: its own config's
        ``hydra.launcher`` values (an experiment file or a sweep override may set them per
        job)."""
        own = OmegaConf.select(sweep_config, "hydra.launcher") or {}
        timeout_s = self.timeout_s
        if "timeout_min" in own:
            minutes = own["timeout_min"]
            timeout_s = None if minutes is None else float(minutes) * 60
        env = {**self.env, **{str(k): str(v) for k, v in (own.get("env") or {}).items()}}
        return timeout_s, env, str(own.get("python") or self.python)

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"memlab launcher: {len(job_overrides)} jobs, {self.parallel} at a time, "
                 "each in its own process")
        module, qualname = self._task_ref()
        jobs = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            sweep_config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"{os.getpid()}_{idx}"
                sweep_config.hydra.job.num = idx
            console_only(sweep_config)  # its log records reach memlab.log through its console
            HydraConfig.instance().set_config(sweep_config)
            subdir = str(sweep_config.hydra.sweep.subdir)
            with read_write(sweep_config.hydra.sweep):
                # pin what the job process would otherwise resolve again (``${now:}``)
                sweep_config.hydra.sweep.dir = str(sweep_dir)
                sweep_config.hydra.sweep.subdir = subdir
            timeout_s, env, python = self._job_settings(sweep_config)
            jobs.append(_Job(idx, list(overrides), sweep_config, sweep_dir / subdir, timeout_s,
                             env, python))
        self._check_choices(jobs)
        results: dict[int, JobReturn] = {}
        pending = list(jobs)
        running: list[_Job] = []
        free_devices = list(self.devices)
        tmp = Path(tempfile.mkdtemp(prefix="memlab_launch_"))
        stop = _SweepStop()
        try:
            with stop:
                while running or (pending and stop.signum is None):
                    while stop.signum is None and pending and len(running) < self.parallel:
                        job = pending.pop(0)
                        job.device = free_devices.pop(0) if free_devices else None
                        log.info(f"\t#{job.idx} : {' '.join(filter_overrides(job.overrides))}"
                                 + (f"  [device {job.device}]" if job.device is not None
                                    else ""))
                        self._start(job, module, qualname, tmp)
                        running.append(job)
                    time.sleep(0.2)
                    for job in list(running):
                        self._supervise(job, stop)
                        if job.process().poll() is None:
                            continue
                        running.remove(job)
                        if job.device is not None:
                            free_devices.append(job.device)
                        results[job.idx] = self._collect(job, sweep_dir)
                for job in pending:  # never started: the sweep was interrupted
                    results[job.idx] = self._not_run(job, sweep_dir, stop.signum)
        finally:
            for job in running:  # only on an error in this loop: leave no orphan behind
                _kill_group(job.process())
            shutil.rmtree(tmp, ignore_errors=True)
        ended = [str((results[j.idx].return_value or {}).get("status")) for j in jobs]
        _ENDED.extend(ended)
        how = (f"interrupted by {signal.Signals(stop.signum).name}" if stop.signum
               else "finished")
        print(f"[memlab] sweep {how}: {count_line(_ENDED)}; summaries under {sweep_dir} "
              f"(memlab report {sweep_dir})", flush=True)
        if stop.signum is not None:
            raise SystemExit(128 + stop.signum)
        return [results[j.idx] for j in jobs]

    def _check_choices(self, jobs: list[_Job]) -> None:
        """Refuse the sweep, before any job starts (exit 2), when a job names an option its
        group does not have: Hydra runs the default of an optional group instead (a sweep
        file's ``hydra.sweeper.params`` reach the jobs so, past the command line's check)."""
        from memlab.cli.overrides import unknown_choices
        from memlab.registry import ConfigErrors

        assert self.hydra_context is not None
        loader, cache = self.hydra_context.config_loader, {}

        def options(group: str) -> list[str]:
            if group not in cache:
                cache[group] = loader.get_group_options(group)
            return cache[group]

        bad: list[str] = []
        for job in jobs:
            found = unknown_choices(job.config.hydra.runtime.choices, options, job.overrides)
            bad += [f"job #{job.idx}: {p}" for p in found]
        if bad:
            print(f"[memlab] sweep refused, no job started: "
                  f"{str(ConfigErrors(bad)).replace('configuration', 'sweep', 1)}",
                  file=sys.stderr, flush=True)
            raise SystemExit(2)

    def _start(self, job: _Job, module: str, qualname: str, tmp: Path) -> None:
        payload = tmp / f"job_{job.idx}.pkl"
        job.result = tmp / f"job_{job.idx}.result.pkl"
        with open(payload, "wb") as f:
            pickle.dump({"config": job.config, "module": module, "qualname": qualname,
                         "result": str(job.result), "parent": os.getpid()}, f)
        # the job's console is copied as it comes (memlab.log; the console when one at a time)
        env = {**os.environ, **job.env, "PYTHONUNBUFFERED": "1", RECORD_ID_ENV: job.record_id}
        if job.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = job.device
        job.dir.mkdir(parents=True, exist_ok=True)
        remove_links(job.dir, [".hydra/config.yaml", ".hydra/hydra.yaml",
                               ".hydra/overrides.yaml"])  # Hydra would write through them
        # its own session: a Ctrl-C reaches the launcher only, which stops the job in order
        if self._forks(env, job.python):
            read, write = os.pipe()
            try:
                proc: Any = starter.Forked(starter.fork(
                    WORKER, [str(payload)], env, write, write, preload=True,
                    orphan_kill_s=None, name=f"job{job.idx}"))
            finally:
                os.close(write)
            output = os.fdopen(read, "rb")
        else:
            proc = subprocess.Popen([job.python, "-m", WORKER, str(payload)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    cwd=os.getcwd(), start_new_session=True)
            assert proc.stdout is not None
            output = proc.stdout
        job.proc = proc
        job.log = JobLog(output, job.dir / "memlab.log", echo=self.parallel == 1)
        job.started = time.time()
        job.watch = OomWatch(proc.pid)

    def _forks(self, env: dict[str, str], python: str | None = None) -> bool:
        """Whether the job is forked from memlab's fork server (:mod:`memlab.distributed.
        starter`: torch, transformers and memlab imported once for every job, ~3.5 s of CPU a
        job saved) rather than started as ``python -m`` (``python`` set; a CUDA machine, where a
        fork of a process that imported ahead cannot use the device; ``fork_server=false``; an
        environment whose import-time variables differ from the server's). ``python``: the
        job's own interpreter (None: the launcher's)."""
        return (self.fork_server and (python or self.python) == sys.executable
                and starter.serves(env))

    def _supervise(self, job: _Job, stop: _SweepStop) -> None:
        """Stop the job when the sweep is interrupted or its time is up (the stop signal first,
        SIGKILL after the grace period or at a second interrupt)."""
        proc = job.process()
        if proc.poll() is not None:
            return
        if job.watch is not None:  # a cgroup the job moved into (a wrapper's) gets a baseline
            job.watch.observe()
        now = time.time()
        if job.stopped_by is None:
            if stop.signum is not None:
                job.stopped_by, job.stop_signal = "interrupt", signal.Signals(stop.signum).name
            elif job.timeout_s is not None and now - job.started > job.timeout_s:
                job.stopped_by, job.stop_signal = "timeout", "SIGTERM"
                log.warning(f"job #{job.idx}: {job.timeout_s / 60:g} min are up; stopping it")
            if job.stopped_by is not None and job.stop_signal is not None:  # just stopped
                job.stop_sent = now
                _signal(proc, signal.Signals[job.stop_signal])
                if job.stopped_by == "interrupt":
                    log.warning(f"job #{job.idx}: stopping it ({job.stop_signal}: it records "
                                f"what it measured); {job.stop_signal} again kills it at once")
        elif not job.killed and (now - job.stop_sent > self.grace_s or stop.count > 1):
            job.killed = (f"the sweep got {_signame(stop.signum or 0)} a second time"
                          if stop.count > 1 and job.stopped_by == "interrupt" else
                          f"it did not stop within stop_grace_s={self.grace_s:g}")
            _kill_group(proc)

    def _collect(self, job: _Job, sweep_dir: Path) -> JobReturn:
        """The job's record, completed with what only the launcher knows."""
        code = job.process().returncode
        if job.log is not None:
            job.log.join()
        seconds = time.time() - job.started
        ret = None
        if code == 0 and job.result is not None and job.result.exists():
            with open(job.result, "rb") as f:
                ret = pickle.load(f)
        own = None
        if isinstance(ret, JobReturn) and ret.status == JobStatus.COMPLETED and isinstance(
                ret._return_value, dict):
            own = ret._return_value
        if own is None:
            own = read_summary(job.dir / "summary.json", job.record_id)
        why: str | None
        if job.stopped_by == "timeout" and job.timeout_s is not None:
            status = "timeout"
            why = (f"stopped by the launcher after timeout_min={job.timeout_s / 60:g} "
                   f"({seconds:.0f} s, {job.stop_signal}"
                   + (f", then SIGKILL: {job.killed}" if job.killed else "") + ")")
            if own and own.get("train"):
                why += f"; recorded {own['train'].get('steps')} step(s) before it stopped"
        elif job.stopped_by == "interrupt":
            status = "interrupted"
            why = (own or {}).get("error") if (own or {}).get("status") == "interrupted" else (
                f"the sweep was interrupted by {job.stop_signal} while this job ran"
                + (f"; killed with SIGKILL before it recorded its end ({job.killed})"
                   if job.killed else ""))
        elif own is not None and code == 0:
            return self._return(job, own, write=ret is None)
        elif code < 0:
            status, why = killed_status(-code, job.watch)
        elif own is not None and own.get("status") not in (None, "ok"):
            return self._return(job, own, write=False)  # it recorded its end (interrupted...)
        elif own is not None and code in (130, 143):
            return self._return(job, own, write=False)  # stopped right after a complete record
        else:
            status = "failed"
            why = (f"job process exited with code {code} before writing a result "
                   f"(see {job.dir}/memlab.log)")
        record = dict(own) if own else self._skeleton(job, sweep_dir)
        if own and own.get("status") != status:
            record["recorded_status"] = own.get("status")
        record.update(status=status, error=why, exit_code=code)
        record.setdefault("wall_time_s", seconds)
        if job.stop_signal or code < 0:  # the signal sent (not the SIGKILL that may follow)
            record["signal"] = job.stop_signal if job.stopped_by else _signame(-code)
        log.warning(f"job #{job.idx} ({job.dir}): {status}: {why}")
        return self._return(job, record, write=True)

    def _not_run(self, job: _Job, sweep_dir: Path, signum: int | None) -> JobReturn:
        record = self._skeleton(job, sweep_dir)
        sig = signal.Signals(signum).name if signum else "a stop signal"
        record.update(status="not_run",
                      error=f"not started: the sweep was interrupted by {sig} before its turn")
        return self._return(job, record, write=True)

    def _skeleton(self, job: _Job, sweep_dir: Path) -> dict[str, Any]:
        """A record for a job that wrote none: what it was, nothing measured."""
        return {"schema_version": SCHEMA_VERSION,
                **dict.fromkeys(("memory", "throughput", "data", "train", "versions", "device",
                                 "wall_time_s")),
                "status": None, "error": None, "overrides": list(job.overrides),
                "choices": _user_choices(job.config), "run_dir": str(job.dir),
                "job": {"record_id": job.record_id,
                        "name": str(OmegaConf.select(job.config, "hydra.job.name")),
                        "num": job.idx, "sweep_dir": str(sweep_dir.resolve())}}

    def _return(self, job: _Job, record: dict[str, Any], write: bool) -> JobReturn:
        if write:
            try:
                where, why = write_summary(job.dir / "summary.json", record)
                if why:
                    log.warning(why)
            except OSError as e:
                log.error(f"job #{job.idx}: its record could not be written anywhere ({e}): "
                          f"{record}")
        ret = JobReturn(overrides=list(job.overrides), cfg=None, hydra_cfg=None,
                        working_dir=str(job.dir), task_name="", status=JobStatus.COMPLETED)
        ret.return_value = record
        return ret


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the job and whatever it started (its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _signal(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _user_choices(sweep_config: DictConfig) -> dict[str, str]:
    """The job's top-level group choices (as memlab.measure.summary.user_choices: no Hydra
    groups, no unselected optional groups, no nested helper groups such as debug/data)."""
    choices = OmegaConf.to_container(sweep_config.hydra.runtime.choices) or {}
    if not isinstance(choices, dict):
        return {}
    return {str(k): str(v) for k, v in choices.items()
            if v is not None and "/" not in str(k) and "@" not in str(k)}
