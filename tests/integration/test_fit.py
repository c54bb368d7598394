"""``memlab fit`` on the tiny default: a budget under the default run's peak gives a measured
configuration under the budget that trains exactly like the default (only exact techniques are
searched here); the forbidden techniques never appear; a budget nothing fits gets the closest
candidates and what would make them fit. One search shared by the assertions; the default run
and the winner's experiment run go through memlab's Hydra app in this process (a fresh process
each is what fit's own measured runs already are)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlab.cli.fit import fit, main
from memlab.cli.fit.search import FitOptions, estimate_candidate, read_run
from memlab.cli.fit.space import Candidate
from memlab_testing import app, check_record

pytestmark = pytest.mark.integration

# fixed: packing (not exact), padding-free rows and the loss (chunked, as every candidate that
# fits computes it; the loss dimension's search: tests/unit/cli/test_fit_space.py). The default
# (4 rows a micro-batch, checkpointing every layer: 54.4 MiB estimated and measured, every row of
# its batches cut at max_length 512) fits only with smaller micro-batches (2 x 2 or 1 x 4: 40-50
# MiB). Rows of 512: 1024, the default, made every step twice as long for the same assertions
# (the default over the budget, two exact classes under it); 64 examples: the runs train on
# 6 x 4 of them (2000 cost a tokenization per run).
BASE = ["packing=none", "method.padding_free=false", "method.loss_impl=chunked", "precision=fp32",
        "method.max_length=512", "data.n_examples=64"]
BUDGET = 53 * 2**20
N = 9  # checkpointing (3) x micro-batch (4x1, 2x2, 1x4)
STEPS = 10  # at least 3 timed (not tracked, not warm-up) steps: tokens/s is ranked from 3


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit")
    # measure=2: three fit (two of one predicted class); one run per class is the check
    # measure_budget_s=0: no second round for a tie (tests/unit/cli/test_fit_measure.py)
    record = fit(BASE, FitOptions(budget_bytes=BUDGET, measure=2, steps=STEPS, jobs=2,
                                  measure_budget_s=0), out, ["--budget", "53MiB", *BASE])
    assert app([*BASE, f"train.steps={STEPS}", "train.progress=false",
                f"hydra.run.dir={out / 'default'}"]) == 0
    return out, record, read_run(out / "default")


def test_the_winner_is_measured_under_the_budget_and_trains_like_the_default(searched):
    out, record, default = searched
    assert default["status"] == "ok" and default["peak_bytes"] > BUDGET  # the default does not fit
    w = record["winner"]
    assert w is not None and w["exact"], record["nothing_fits"]
    m = w["measured"]
    assert m["status"] == "ok" and m["peak_bytes"] <= BUDGET
    assert m["loss_curve"] == pytest.approx(default["loss_curve"], rel=1e-4)
    measured = [c for c in record["candidates"] if c["measured"]]
    # 2: the two fastest predicted classes of the three candidates under 53 MiB
    assert len(measured) >= 2 and all(c["estimate"]["fits"] for c in measured)
    for c in measured:  # fit's runs wrote records of the typed layout
        check_record(Path(c["measured"]["run_dir"]))
    for c in measured:  # none that fits and is timed is faster beyond the measured spread
        if c["measured"]["fits"] and (c["measured"]["timed_steps"] or 0) >= 3:
            gap = c["measured"]["tokens_per_s"] - m["tokens_per_s"]
            assert gap <= max(m["tokens_per_s_std"], c["measured"]["tokens_per_s_std"]), c
    assert record["prediction"]["classes"] >= 2  # one measured per predicted class
    for c in measured:  # the estimate is the worst case the settings allow: never below a run
        assert c["measured"]["peak_bytes"] <= c["estimate"]["peak_bytes"] * 1.01, c["label"]
    assert record["prediction"]["points"] == len(measured)
    assert json.loads((out / "fit.json").read_text())["winner"]["label"] == w["label"]


def test_only_the_allowed_space_is_searched(searched):
    _, record, _ = searched
    assert {d["name"] for d in record["space"]} == {"checkpointing", "micro_batch"}
    assert len(record["candidates"]) == N
    for c in record["candidates"]:  # each estimated, or pruned (tests/integration/test_fit_prune)
        assert not any(o.split("=")[0] in ("peft", "precision", "distributed", "packing",
                                           "method.padding_free", "method.loss_impl")
                       for o in c["overrides"])
        assert c["pruned"] or (c["estimate"]["status"] == "ok"
                               and c["estimate"]["flops_per_step"] > 0) or (
            c["estimate"]["status"] == "over_budget" and not c["estimate"]["fits"]
            and c["estimate"]["needed_at_least_bytes"] * 1.05 > BUDGET)  # stopped
    assert any("not searched unless allowed" in n for n in record["notes"])


def test_estimates_made_in_worker_processes_are_the_serial_ones(searched):
    """The search estimated the candidates two at a time in forked workers (the first in fit's
    own process): each equals its estimate made alone in this process."""
    _, record, _ = searched
    opts = FitOptions(budget_bytes=BUDGET)
    made = record["search"]["made"]
    for c in [record["candidates"][i] for i in made[1:][-2:]]:  # made by workers
        alone = estimate_candidate(BASE, Candidate(c["overrides"], c["label"], c["exact"]), opts,
                                   stop=True)  # (as the search: stopped over the budget)
        assert {k: v for k, v in alone.items() if k not in ("seconds", "cpu_s")} == {
            k: v for k, v in c["estimate"].items() if k not in ("seconds", "cpu_s")}, c["label"]


def test_sigterm_stops_the_search_and_leaves_a_partial_fit_json(tmp_path, capsys):
    """SIGTERM while the workers estimate: fit stops them, writes fit.json (interrupted, the
    candidates estimated so far, no winner) and exits 143 (128 + SIGTERM); no worker outlives
    it. While the search holds ``--out``, a second search there is refused (exit 2)."""
    import signal

    out = tmp_path / "fit"
    proc = subprocess.Popen([sys.executable, "-m", "memlab", "fit", "--budget", "53MiB",
                             "--estimate-only", "--jobs", "2", "--out", str(out), *BASE],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the first estimate is made before the workers start; a
        seen.append(line)  # worker's first one reported: the workers are estimating the rest
        if line.startswith("[fit] estimate ") and not line.startswith(f"[fit] estimate 1/{N}"):
            break
    assert main(["--budget", "53MiB", "--out", str(out), *BASE]) == 2  # in use: refused
    assert "is in use by another memlab job" in capsys.readouterr().err
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + err[-2000:]
    record = json.loads((out / "fit.json").read_text())
    assert record["status"] == "interrupted" and record["signal"] == "SIGTERM"
    estimated = [c for c in record["candidates"] if c["estimate"]]
    assert 2 <= len(estimated) < N and record["winner"] is None
    assert all(c["estimate"]["status"] in ("ok", "over_budget") for c in estimated)
    left = [p for p in os.listdir("/proc") if p.isdigit() and str(out) in _cmdline(p)]
    assert not left, left


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_the_winner_runs_as_an_experiment(searched):
    out, record, _ = searched
    assert app(["--config-dir", str(out), "experiment=fit", "train.steps=2",
                "train.progress=false", f"hydra.run.dir={out}/again"]) == 0
    cfg = json.loads((out / "again" / "summary.json").read_text())["config"]
    for o in record["winner"]["overrides"] + BASE:
        key, value = o.split("=", 1)
        if "." in key:
            section, name = key.split(".")
            assert str(cfg[section][name]).lower() == value.lower(), o


def test_a_budget_nothing_fits_names_the_closest_and_what_would_fit(tmp_path, capsys):
    code = main(["--budget", "1MiB", "--out", str(tmp_path), "packing=none", "precision=fp32",
                 "train.batch_size=4", "train.gradient_checkpointing=true",
                 "train.checkpoint_every=1"])
    assert code == 1
    record = json.loads((tmp_path / "fit.json").read_text())
    assert record["winner"] is None and not (tmp_path / "runs").exists()
    closest = record["nothing_fits"]["closest"]
    assert len(closest) == 3 and all(c["over_by_bytes"] > 0 for c in closest)
    assert closest[0]["needed_bytes"] <= closest[1]["needed_bytes"]
    assert all(c["what_would_fit"] for c in closest)
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["--budget", "1GiB", "--allow", "lora"],
                                  ["--budget", "1GiB", "--steps", "1"],
                                  ["--budget", "1GiB", "--bogus"]])
def test_bad_command_lines_exit_2(argv, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
