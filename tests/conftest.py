"""pytest setup: one thread per process, offline hubs, the ``job`` fixture, the tiers, and the
guard that fails a test which leaves process-global state changed or depends on this machine.

- Tiers (tests/tiers.py): a test outside tests/unit is marked ``pipeline`` at collection; every
  test lands in exactly one tier.
- The guard (every test): memlab's runs report two events to a per-process directory
  (``MEMLAB_TEST_EVENTS``, :func:`memlab.faults.note`), spawned processes included: a test that
  resolves ``precision=auto`` fails unless marked ``auto_precision(reason)`` (its numbers would
  depend on whether this CPU has bf16 kernels), and a ``check`` test that builds a pipeline
  fails. A ``check`` test whose call takes over ``tiers.CHECK_LIMIT_S`` of CPU (or
  ``tiers.CHECK_WALL_S`` of wall time) fails. After every test
  the process-global state a test can leak (:func:`global_state`) must be as it was before; a
  test that changed it fails, naming what changed, and the state is put back for the next one.
- ``--durations-file=PATH`` (with ``=``: given apart, an existing PATH is taken for a test path
  before this conftest is loaded, and the option is refused): every test's duration, outcome,
  tier, when it ended (seconds into the session) and its call's CPU time (its process's and
  its waited-for children's), slowest first (TSV), written by the process that reports (the
  xdist controller); scripts/test.sh keeps them in ``.test-durations/`` (``python tests/schedule.py``
  turns them into tests/weights.tsv, the order xdist hands files out: longest first).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

import schedule
from memlab_testing import REPO, job  # noqa: F401  (fixture)
from tiers import (
    MARKERS,
    TIERS,
    UNIT,
    check_limit_problem,
    cpu_s,
    folder_problem,
    load_per_core,
    tier_of,
)

EVENTS = Path(tempfile.mkdtemp(prefix="memlab-test-events-"))
os.environ["MEMLAB_TEST_EVENTS"] = str(EVENTS)  # this process and every one it spawns
# the runs tests share (memlab_testing.shared_job): made by the process that starts the session,
# inherited by xdist's workers, removed when the session ends
SHARED = None if "MEMLAB_TEST_SHARED" in os.environ else tempfile.mkdtemp(
    prefix="memlab-shared-runs-")
if SHARED is not None:
    os.environ["MEMLAB_TEST_SHARED"] = SHARED

ENV_PREFIXES = ("MEMLAB_", "WANDB_", "HF_")
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM",
             "TRITON_INTERPRET", "VLLM_ENABLE_V1_MULTIPROCESSING")
"""The environment variables memlab reads (a library setting one of its own on import, as
DeepSpeed sets PYTORCH_NVML_BASED_CUDA_CHECK, is not a test's leak)."""


def pytest_configure(config):
    """``pytest`` with no arguments runs the check tier; named tests, paths or ``-m`` run what
    they name."""
    if (not config.option.markexpr
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS):
        config.option.markexpr = TIERS["check"]
    config.pluginmanager.register(_LongestFirst(), "memlab-longest-first")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    problems = []
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(REPO).as_posix()
        if not rel.startswith(UNIT + "/") or item.get_closest_marker("integration"):
            item.add_marker("pipeline")
        markers = {m.name for m in item.iter_markers()} & set(MARKERS)
        tiers = tier_of(markers)
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: in tiers {tiers} (tests/tiers.py)")
            continue
        item.stash[TIER] = tiers[0]
        item.user_properties.append(("tier", tiers[0]))  # its reports carry it to xdist's controller
        if (why := folder_problem(rel, tiers[0])) is not None:
            problems.append(why)
    if problems:
        raise pytest.UsageError("test tiers:\n" + "\n".join(sorted(set(problems))))


class _LongestFirst:
    """The longest files first (tests/schedule.py; xdist keeps this order with
    ``--no-loadscope-reorder``, set in pyproject's addopts), the check tier's before the others
    (``make test`` runs the check and main tiers in one session). A plugin of its own: a
    conftest holds one function per hook name."""

    @pytest.hookimpl(trylast=True)  # after -m deselected: what runs
    def pytest_collection_modifyitems(self, config, items):
        files = {i: schedule.file_of(item.nodeid) for i, item in enumerate(items)}
        first = frozenset(files[i] for i, item in enumerate(items) if _tier(item) == "check")
        items[:] = schedule.longest_first(items, files, schedule.read_weights(), first)


TIER = pytest.StashKey[str]()


def _tier(item) -> str:
    return item.stash.get(TIER, "main")


@pytest.fixture(scope="module")
def no_cpu_bf16():
    """``MEMLAB_CPU_BF16=0`` for a module: ``precision=auto`` is fp32 on any CPU, as on an
    AVX2-only one. For tests that validate or build configurations whose precision does not
    matter to what they check (``pytestmark = pytest.mark.usefixtures("no_cpu_bf16")``, set
    up before the module's own fixtures)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMLAB_CPU_BF16", "0")
        yield


# --- the guard --------------------------------------------------------------------------------

def _nn_hooks() -> dict:
    import torch.nn.modules.module as nn_module

    return {name: dict(value) if isinstance(value, dict) else value
            for name, value in vars(nn_module).items() if name.startswith("_global_")}


def _patch_targets() -> dict:
    from memlab.measure.patches import GLOBAL_TARGETS

    out = {}
    for module, path in GLOBAL_TARGETS:
        if module not in sys.modules:  # nothing imported it: nothing could patch it
            continue
        owner = sys.modules[module]
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        out[f"{module}.{path}"] = (owner, name, vars(owner).get(name, None))
    return out


def global_state() -> dict:
    """What a test can leave changed in the process for the tests after it."""
    import torch
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    handlers = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGALRM):
            continue  # SIGALRM: pytest-timeout's, set and cleared around each test
        try:
            handlers[signal.Signals(sig).name] = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
    return {
        "signal handlers": handlers,
        "torch default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "autocast": {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                     for d in ("cpu", "cuda")} | {"cache": torch.is_autocast_cache_enabled(),
                                                  "nesting": _autocast_nesting()},
        "deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled(),
                                     torch.backends.cudnn.deterministic,
                                     torch.backends.cudnn.benchmark),
        "torch threads": torch.get_num_threads(),
        "saved-tensors default hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "dispatch modes": [type(m).__name__ for m in _get_current_dispatch_mode_stack()],
        "function modes": [type(m).__name__ for m in _get_current_function_mode_stack()],
        "torch.nn global module hooks": _nn_hooks(),
        "memlab.measure.patches targets": {k: v[2] for k, v in _patch_targets().items()},
        "environment": {k: v for k, v in os.environ.items()
                        if k.startswith(ENV_PREFIXES) or k in ENV_NAMES},
        "cwd": os.getcwd(),
    }


def _autocast_nesting() -> int:
    """How many autocast contexts are open (autocast clears its weight cache when the last one
    closes: one left open keeps stale casts for the rest of the process)."""
    import torch

    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


def _changed(before: dict, after: dict) -> list[str]:
    out = []
    for key, was in before.items():
        now = after[key]
        if now == was:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            # a patch target whose module the test imported first was not changed by it
            keys = sorted(set(was) | (set(now) if key != "memlab.measure.patches targets"
                                      else set()), key=str)
            diff = [f"{k}: {was.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}"
                    for k in keys if was.get(k, "<unset>") != now.get(k, "<unset>")]
            if diff:
                out.append(f"{key}: " + "; ".join(diff))
        else:
            out.append(f"{key}: {was!r} -> {now!r}")
    return out


def _restore(before: dict) -> None:
    """Put back what a test changed, so one leak fails one test, not every test after it."""
    import torch
    import torch.nn.modules.module as nn_module

    for name, handler in before["signal handlers"].items():
        if handler is not None and signal.getsignal(signal.Signals[name]) is not handler:
            signal.signal(signal.Signals[name], handler)
    torch.set_default_dtype(before["torch default dtype"])
    torch.set_grad_enabled(before["grad mode"])
    for d in ("cpu", "cuda"):
        on, dtype = before["autocast"][d]
        torch.set_autocast_enabled(d, on)
        torch.set_autocast_dtype(d, dtype)
    torch.set_autocast_cache_enabled(before["autocast"]["cache"])
    while _autocast_nesting() > before["autocast"]["nesting"]:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
    while _autocast_nesting() < before["autocast"]["nesting"]:
        torch.autocast_increment_nesting()
    det, warn_only, cudnn_det, cudnn_bench = before["deterministic algorithms"]
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, cudnn_bench
    torch.set_num_threads(before["torch threads"])
    for name, value in before["torch.nn global module hooks"].items():
        current = getattr(nn_module, name)
        if isinstance(current, dict):
            current.clear()
            current.update(value)
    for key, (owner, name, _) in _patch_targets().items():
        was = before["memlab.measure.patches targets"].get(key)
        if was is not None:
            setattr(owner, name, was)
    for k in set(os.environ) - set(before["environment"]):
        if k.startswith(ENV_PREFIXES) or k in ENV_NAMES:
            del os.environ[k]
    os.environ.update(before["environment"])
    os.chdir(before["cwd"])


def _events() -> list[str]:
    """The events memlab's processes reported since the last call (and forget them)."""
    out = []
    for f in EVENTS.glob("*.events"):
        try:
            out += f.read_text().split()
            f.unlink()
        except OSError:
            continue
    return out


@pytest.fixture(autouse=True)
def _guard(request):
    # the events since the last test ended belong to this one (its module fixtures' setup)
    before = global_state()
    yield
    problems = []
    events = _events()
    auto = sorted({e for e in events if e.startswith("precision=auto")})
    if auto and request.node.get_closest_marker("auto_precision") is None:
        problems.append(
            f"resolved {auto[0]} on this machine's CPU (bf16 kernels decide it): pin the "
            "precision (precision=fp32, as memlab_testing.FAST does), set MEMLAB_CPU_BF16=1|0 "
            "for the run, or mark the test @pytest.mark.auto_precision('why it means to')")
    if "pipeline" in events and _tier(request.node) == "check":
        problems.append("built a pipeline in the check tier: mark it pytest.mark.pipeline "
                        "(the main tier) or test the piece without a run")
    changed = _changed(before, global_state())
    if changed:
        _restore(before)
        problems.append("left process-global state changed (put back for the next test):\n  "
                        + "\n  ".join(changed))
    if problems:
        pytest.fail(f"{request.node.nodeid}: " + "\n".join(problems), pytrace=False)


_CALL_CPU = pytest.StashKey[float]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    start = cpu_s()
    try:
        return (yield)
    finally:
        item.stash[_CALL_CPU] = cpu_s() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The call's CPU time goes into the report (the durations file's ``cpu`` column); a check
    test over the tier's limits fails (:func:`tiers.check_limit_problem`)."""
    report = yield
    if call.when != "call":
        return report
    cpu = item.stash.get(_CALL_CPU, 0.0)
    report.user_properties.append(("cpu", cpu))
    if report.passed and _tier(item) == "check":
        over = check_limit_problem(item.nodeid, cpu, call.duration, load_per_core())
        if over:
            report.outcome, report.longrepr = "failed", over
    return report


# --- durations --------------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--durations-file", metavar="PATH", default=None,
                     help="write every test's duration (s), outcome and tier, slowest first")


_DURATIONS: dict[str, list] = {}
_STARTED = time.monotonic()


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    row = _DURATIONS.setdefault(report.nodeid, [0.0, "passed", props.get("tier", "?"), 0.0, 0.0])
    row[0] += report.duration
    row[3] = time.monotonic() - _STARTED  # when its last report came
    if report.when == "call":
        row[4] = props.get("cpu", 0.0)
    if report.failed:
        row[1] = "failed" if report.when == "call" else f"error ({report.when})"
    elif report.skipped and row[1] == "passed":
        row[1] = "skipped"


def pytest_sessionfinish(session):
    path = session.config.getoption("--durations-file")
    if path and not hasattr(session.config, "workerinput"):
        rows = sorted(_DURATIONS.items(), key=lambda kv: -kv[1][0])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("seconds\toutcome\ttier\tended\tcpu\ttest\n" + "".join(
            f"{s:.2f}\t{outcome}\t{tier}\t{ended:.1f}\t{cpu:.2f}\t{nodeid}\n"
            for nodeid, (s, outcome, tier, ended, cpu) in rows))
    shutil.rmtree(EVENTS, ignore_errors=True)
    if SHARED is not None:
        shutil.rmtree(SHARED, ignore_errors=True)
