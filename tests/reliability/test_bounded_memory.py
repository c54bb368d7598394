"""Issue 43, item 6: an estimate of an absurd micro-batch answers in bounded memory and time.

``memlab estimate train.batch_size=1000000`` (or ``method.max_length=10000000``) grew to 4-6 GB
with no output: the worst-case rows were built as Python lists before anything was fake. Now a
micro-batch over :data:`memlab.estimate.bounds.MEASURED_TOKENS` is never built: the estimate is
``invalid``, naming the largest card its token ids alone, or a lower bound measured at two
smaller sizes, would exceed (:mod:`memlab.estimate.bounds`). The commands run as a user runs
them, in a subprocess whose own peak RSS and CPU time ``os.wait4`` reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlab.estimate import EstimateOptions, validate_for
from memlab.estimate.bounds import Size, _resized, lower_bound, peak_of
from memlab.estimate.fake import run_fake_step
from memlab_testing import compose
from reliability.helpers import ENV

pytestmark = [pytest.mark.integration]

GB = 1 << 30


HWM = ("import atexit, runpy, sys\n"
       "out = sys.argv.pop(1)\n"
       "def hwm():\n"
       "    with open('/proc/self/status') as f, open(out, 'w') as o:\n"
       "        o.write([x for x in f if x.startswith('VmHWM:')][0].split()[1])\n"
       "atexit.register(hwm)\n"
       "sys.argv[0] = 'memlab'\n"
       "runpy.run_module('memlab', run_name='__main__', alter_sys=True)\n")
"""``python -m memlab`` that writes its own peak RSS (VmHWM, KiB) to the file named first: the
high-water mark of the process's own memory (``ru_maxrss`` keeps that of the process it was
forked from, a large test worker's)."""


def _estimate_process(tmp_path: Path, *overrides: str) -> tuple[dict, float, int]:
    """``memlab estimate OVERRIDES`` in its own process: (estimate.json, CPU seconds, peak RSS
    bytes) of that process alone."""
    run_dir = tmp_path / "est"
    proc = subprocess.Popen(
        [sys.executable, "-c", HWM, str(tmp_path / "hwm"), "estimate", *overrides,
         f"hydra.run.dir={run_dir}"],
        env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read().decode() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    result = json.loads((run_dir / "estimate.json").read_text())
    assert proc.returncode == 2, out  # invalid: exit 2, as any invalid estimate
    return result, usage.ru_utime + usage.ru_stime, int((tmp_path / "hwm").read_text()) * 1024


@pytest.mark.parametrize("override, says", [
    ("train.batch_size=1000000", "convex in the rows"),
    ("method.max_length=10000000", "convex in the tokens a row"),
])
def test_absurd_micro_batch_is_refused_naming_the_card(tmp_path, override, says):
    result, cpu_s, rss = _estimate_process(tmp_path, override)
    assert result["status"] == "invalid"
    assert "more than the largest card memlab knows, NVIDIA H200 141GB" in result["error"]
    assert says in result["error"] and "needs at least" in result["error"]
    assert rss < GB, f"peak RSS {rss / 2**20:.0f} MiB"
    assert cpu_s <= 10, f"{cpu_s:.1f} s of CPU"


def test_token_ids_alone_and_other_methods():
    """Ids over the largest card are refused at once, without measuring anything; DPO (rows
    generated through its own prepare: no proven bound) is refused as too large to build."""
    from omegaconf import OmegaConf, open_dict

    from memlab.estimate import estimate

    def est(*overrides: str) -> dict:
        cfg = compose(["method=dpo", "method.max_length=10000000", *overrides])
        with open_dict(cfg):
            del cfg["hydra"]
        return estimate(OmegaConf.create(OmegaConf.to_container(cfg)), EstimateOptions())

    result = est("train.batch_size=2000")
    assert result["status"] == "invalid"
    assert "its token ids alone (149.01 GiB as int64) would exceed the largest card memlab " \
           "knows, NVIDIA H200 141GB" in result["error"]
    result = est()
    assert result["status"] == "invalid"
    assert "is more than memlab estimate builds and measures in bounded memory" \
           in result["error"], result["error"]


def _ctx(*overrides: str):
    from omegaconf import OmegaConf, open_dict

    cfg = compose(["precision=fp32", *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    return validate_for(OmegaConf.create(OmegaConf.to_container(cfg)), "cpu")


def _peak(ctx, opts) -> int:
    return peak_of(run_fake_step(ctx, opts, []))


@pytest.mark.parametrize("overrides, target", [
    (["attention=sdpa"], Size(48, 1024)),  # the rows: probes at 8 and 16 rows
    (["attention=eager"], Size(2, 16384)),  # the length, with eager's dense [T, T] mask
], ids=["rows", "length-eager"])
def test_lower_bound_is_below_the_measured_peak(overrides, target):
    """The refusal's bound (the line through two smaller measured peaks) never passes the peak
    measured at the size itself: the convexity it rests on, on both axes."""
    ctx, opts = _ctx(*overrides), EstimateOptions()
    found = lower_bound(ctx, opts, target, _peak)
    assert found is not None
    measured = _peak(*_resized(ctx, opts, target))
    assert found[0] <= measured, (found, measured)
    if target.length == 1024:  # linear in the rows: the line is their peak's own
        assert found[0] >= 0.98 * measured, (found, measured)


def test_from_data_batch_larger_than_the_data_is_invalid():
    """``--from-data`` measures the run's own batches, bounded by its data: a micro-batch of
    more rows than the data has is ``invalid`` with the run's own message (was a traceback)."""
    from omegaconf import OmegaConf, open_dict

    from memlab.estimate import estimate

    cfg = compose(["train.batch_size=1000000", "data.n_examples=8", "method.max_length=64"])
    with open_dict(cfg):
        del cfg["hydra"]
    result = estimate(OmegaConf.create(OmegaConf.to_container(cfg)),
                      EstimateOptions(from_data=True))
    assert result["status"] == "invalid"
    assert "train.batch_size=1000000 asks for 1000000 rows per micro-batch" in result["error"]
