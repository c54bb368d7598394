"""Shared test helpers: compose the real Hydra config and run jobs in-process.

Imported by conftest.py and by tests (``tests/`` is on pytest's pythonpath)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import contextlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
"""memlab's configs: config.yaml and one dir per group (a wheel ships them as ``memlab/conf``)."""
SWEEPS = REPO / "sweeps"
"""The ready sweeps, Hydra's group ``sweep`` (``hydra_plugins/memlab_sweeps`` mounts them beside
:data:`CONF`; a wheel ships them as ``memlab/sweeps``)."""

# Small, fast settings every in-process job starts from (tests add their own overrides).
# precision=fp32: the default (auto) is bf16 mixed on a CPU with bf16 kernels; the tests compare
# numbers (a technique on against off, a run against an estimate) in fp32, where they are exact. The
# default itself runs in tests/unit/precision/test_auto.py and in the command-line tests that
# leave precision alone (test_install, test_cli).
FAST = [
    "train.device=cpu",
    "precision=fp32",
    "train.progress=false",
    "train.steps=3",
    "train.batch_size=2",
    "method.max_length=128",
    "data.n_examples=32",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
]


def compose(overrides: list[str]):
    """The real conf/ (and sweeps/) composed with Hydra's compose API (hydra node included)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides,
                             return_hydra_config=True)


def choices_of(cfg) -> dict[str, str]:
    from memlab.measure.summary import user_choices

    return user_choices(cfg.hydra.runtime.choices)


def with_fast(overrides: list[str], fast: list[str] = FAST) -> list[str]:
    """``fast`` (:data:`FAST`; less the settings of a group the overrides switch) +
    ``overrides``."""
    switched = {o.split("=")[0] for o in overrides if "=" in o and "." not in o.split("=")[0]}
    return [o for o in fast if o.split("=")[0].split(".")[0] not in switched] + list(overrides)


def config_errors(overrides: list[str], fast: list[str] = FAST) -> list[str]:
    """Every problem :func:`memlab.context.validate` finds in ``with_fast(overrides, fast)``,
    composed ([]: valid)."""
    from omegaconf import OmegaConf, open_dict

    from memlab.context import validate
    from memlab.registry import ConfigErrors

    cfg = compose(with_fast(overrides, fast))
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        validate(OmegaConf.to_container(cfg, resolve=True))
    except ConfigErrors as e:
        return e.errors
    return []


def check_record(where: Path | dict) -> dict:
    """A summary.json (a dict, a file, or a run dir: its summary.json, from its fallback path
    when it went there, and every ``ranks/rank<r>.json``) conforms to the typed record,
    :mod:`memlab.measure.schema`; returns the summary. Every job the tests run in-process
    (:func:`run_job`, :func:`shared_job`) and the endings the sweep and process tests leave
    are checked with it."""
    import json

    from memlab.measure.schema import check
    from memlab.measure.summary import read_summary

    if isinstance(where, dict):
        found = {"the summary": json.loads(json.dumps(where, default=str))}
    else:
        where = Path(where)
        path = where / "summary.json" if where.is_dir() else where
        record = read_summary(path)  # (a run dir whose record went nowhere: its ranks only)
        found = {} if record is None and where.is_dir() else {str(path): record}
        if where.is_dir():
            found.update({str(p): json.loads(p.read_text())
                          for p in sorted((where / "ranks").glob("rank*.json"))})
    for name, record in found.items():
        assert record is not None, f"no record at {name}"
        problems = check(record)
        assert not problems, f"{name} does not conform to memlab.measure.schema: {problems}"
    return next(iter(found.values()), {})


def run_job(tmp_path: Path, overrides: list[str], fast: bool = True, name: str = "run",
            print_table: bool = False) -> dict:
    """Compose + run one job in this process; returns its summary (checked:
    :func:`check_record`)."""
    from omegaconf import OmegaConf, open_dict

    from memlab.run import run

    cfg = compose(with_fast(overrides) if fast else list(overrides))
    choices = choices_of(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    run_dir = Path(tmp_path) / name
    summary = run(OmegaConf.create(OmegaConf.to_container(cfg)), run_dir, choices, overrides,
                  print_table=print_table)
    check_record(summary)
    if run_dir.is_dir():
        check_record(run_dir)
    return summary


DDP = ["distributed=ddp", "distributed.nproc=2"]
FSDP2 = ["distributed=fsdp2", "distributed.nproc=2"]
STANDARD_LOSS = "method.loss_impl=standard"
"""The loss a distributed run's ``auto`` chooses, pinned where one process is the reference."""
RUN = ["train.steps=4", "measure.memory_steps=2", STANDARD_LOSS, "train.save_every=2",
       "train.save_final=true", "data.median_tokens=3000", "method.loss_on=all"]
"""The training every distributed topology runs once per session (:func:`shared_job`, over
:data:`FAST`: fp32) and every test that checks it reads (test_distributed.py, test_checkpoints.py):
long rows cut at max_length with the loss on every token (every row full: the estimate's worst
case), two tracked steps (an estimate's step 1 after step 0's update), checkpoints at steps 2
and 4 (a resume from step 2 against the straight run)."""
LORA_CHUNKED = ["train.steps=2", "train.save_final=true", "measure.memory_steps=0", "peft=lora",
                "method.loss_impl=chunked", "method.chunk_size=64"]
"""The LoRA + chunked-loss training that one process, DDP ranks and ZeRO-3 ranks run once per
session (test_distributed.py, test_checkpoints.py, test_deepspeed.py read the same runs)."""


def app(argv: list[str]) -> int:
    """``memlab ARGV`` through memlab's Hydra app in this process; its exit status. The root
    logger is put back as it was afterwards: Hydra configures it for the app (its console
    prints every line on stdout), and a later test's run would log through that."""
    from memlab.cli.app import run_app
    from memlab.hydra_task import hydra_task

    with root_logger_kept():
        try:
            run_app(hydra_task, argv)
        except SystemExit as e:
            return int(e.code or 0)
    return 0


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """The root logger's handlers and level as they were before the ``with`` block, afterwards
    (a handler added meanwhile, by Hydra or ``logging.config``, is closed)."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:], root.level = handlers, level


def _session_dir() -> Path:
    """The directory every process of this test session shares (``MEMLAB_TEST_SHARED``, made by
    the process that starts the session, tests/conftest.py, and inherited by xdist's workers)."""
    if "MEMLAB_TEST_SHARED" not in os.environ:
        import tempfile

        os.environ["MEMLAB_TEST_SHARED"] = tempfile.mkdtemp(prefix="memlab-shared-runs-")
    return Path(os.environ["MEMLAB_TEST_SHARED"])


def shared_job(overrides: list[str], fast: bool = True) -> tuple[dict, Path]:
    """One job run once per test session, whichever test (on whichever xdist worker) asks first;
    every test asking for the same overrides reads its summary and run dir (read-only: a test
    that writes into a run dir, or resumes it, runs its own). Returns (summary, run dir).

    Tests that check the same training against the same reference (N ranks against one process,
    an estimate against a run, packed against padded) share the run instead of repeating it."""
    import fcntl
    import hashlib
    import json

    key = hashlib.sha1(json.dumps([overrides, fast]).encode()).hexdigest()[:16]
    where = _session_dir() / key
    with open(_session_dir() / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for the run, then reads it
        done = where / "run" / "summary.json"
        if not done.exists():
            run_job(where, overrides, fast, name="run")  # (checked there)
        return json.loads(done.read_text()), where / "run"


@pytest.fixture
def job(tmp_path):
    counter = {"n": 0}

    def _run(overrides: list[str], fast: bool = True) -> dict:
        counter["n"] += 1
        return run_job(tmp_path, overrides, fast, name=f"run{counter['n']}")

    return _run



def reward_low_ids(completions, *, completion_ids, **_):
    """Test reward for method=grpo: the share of completion tokens whose id is below 2048 (half
    of the tiny tokenizer's vocabulary): ~0.5 at random, with enough spread inside a group for
    a tiny model to learn from within a few steps."""
    return [sum(t < 2048 for t in ids) / max(1, len(ids)) for ids in completion_ids]
