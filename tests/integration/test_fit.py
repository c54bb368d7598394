"""``memlab fit`` on the tiny default: a budget under the default run's peak gives a measured
configuration under the budget that trains exactly like the default (only exact techniques are
searched here); the forbidden techniques never appear; a budget nothing fits gets the closest
candidates and what would make them fit. One search shared by the assertions."""

import json
import os
import subprocess
import sys

import pytest

from memlab.cli.fit import fit, main
from memlab.cli.fit.search import FitOptions, estimate_candidate, run_once
from memlab.cli.fit.space import Candidate

pytestmark = pytest.mark.integration

# fixed: packing (not exact) and padding-free rows; the default (4 rows a micro-batch, the
# chunked loss, checkpointing every layer: ~90 MiB) fits only with smaller micro-batches
BASE = ["packing=none", "method.padding_free=false", "precision=fp32"]
BUDGET = 64 * 2**20
N = 18  # checkpointing (3) x micro-batch (4x1, 2x2, 1x4) x loss (2)
STEPS = 6


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit")
    record = fit(BASE, FitOptions(budget_bytes=BUDGET, measure=3, steps=STEPS, jobs=2), out,
                 ["--budget", "64MiB", *BASE])
    default = run_once(BASE, STEPS, out / "default")
    return out, record, default


def test_the_winner_is_measured_under_the_budget_and_trains_like_the_default(searched):
    out, record, default = searched
    assert default["status"] == "ok" and default["peak_bytes"] > BUDGET  # the default does not fit
    w = record["winner"]
    assert w is not None and w["exact"], record["nothing_fits"]
    m = w["measured"]
    assert m["status"] == "ok" and m["peak_bytes"] <= BUDGET
    assert m["loss_curve"] == pytest.approx(default["loss_curve"], rel=1e-4)
    measured = [c for c in record["candidates"] if c["measured"]]
    # 2: under 64 MiB (the default peaks at 65.9 MiB since the one-temporary step) two fit
    assert len(measured) >= 2 and all(c["estimate"]["fits"] for c in measured)
    for c in measured:  # none that fits is faster beyond the measured spread
        if c["measured"]["fits"] and c["measured"]["tokens_per_s"]:
            gap = c["measured"]["tokens_per_s"] - m["tokens_per_s"]
            assert gap <= max(m["tokens_per_s_std"], c["measured"]["tokens_per_s_std"]), c
    assert record["prediction"]["classes"] >= 2  # one measured per predicted class
    for c in measured:  # the estimate is the worst case the settings allow: never below a run
        assert c["measured"]["peak_bytes"] <= c["estimate"]["peak_bytes"] * 1.01, c["label"]
    assert record["prediction"]["points"] == len(measured)
    assert json.loads((out / "fit.json").read_text())["winner"]["label"] == w["label"]


def test_only_the_allowed_space_is_searched(searched):
    _, record, _ = searched
    assert {d["name"] for d in record["space"]} == {"checkpointing", "micro_batch", "loss"}
    assert len(record["candidates"]) == N
    for c in record["candidates"]:
        assert not any(o.split("=")[0] in ("peft", "precision", "distributed", "packing",
                                           "method.padding_free") for o in c["overrides"])
        assert c["estimate"]["status"] == "ok" and c["estimate"]["flops_per_step"] > 0
    assert any("not searched unless allowed" in n for n in record["notes"])


def test_estimates_made_in_worker_processes_are_the_serial_ones(searched):
    """The search estimated the candidates two at a time in forked workers (the first in fit's
    own process): each equals its estimate made alone in this process."""
    _, record, _ = searched
    opts = FitOptions(budget_bytes=BUDGET)
    for c in record["candidates"][-2:]:  # made by workers
        alone = estimate_candidate(BASE, Candidate(c["overrides"], c["label"], c["exact"]), opts)
        assert {k: v for k, v in alone.items() if k != "seconds"} == {
            k: v for k, v in c["estimate"].items() if k != "seconds"}, c["label"]


def test_sigterm_stops_the_search_and_leaves_a_partial_fit_json(tmp_path):
    """SIGTERM while the workers estimate: fit stops them, writes fit.json (interrupted, the
    candidates estimated so far, no winner) and exits 143 (128 + SIGTERM); no worker outlives
    it."""
    import signal

    out = tmp_path / "fit"
    proc = subprocess.Popen([sys.executable, "-m", "memlab", "fit", "--budget", "64MiB",
                             "--estimate-only", "--jobs", "2", "--out", str(out), *BASE],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the first estimate is made before the workers start; a
        seen.append(line)  # worker's first one reported: the workers are estimating the rest
        if line.startswith("[fit] estimate ") and not line.startswith(f"[fit] estimate 1/{N}"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + err[-2000:]
    record = json.loads((out / "fit.json").read_text())
    assert record["status"] == "interrupted" and record["signal"] == "SIGTERM"
    estimated = [c for c in record["candidates"] if c["estimate"]]
    assert 2 <= len(estimated) < N and record["winner"] is None
    assert all(c["estimate"]["status"] == "ok" for c in estimated)
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
    r = subprocess.run([sys.executable, "-m", "memlab", "--config-dir", str(out),
                        "experiment=fit", "train.steps=2", "train.progress=false",
                        f"hydra.run.dir={out}/again"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((out / "again" / "summary.json").read_text())["config"]
    for o in record["winner"]["overrides"] + BASE:
        key, value = o.split("=", 1)
        if "." in key:
            section, name = key.split(".")
            assert str(cfg[section][name]).lower() == value.lower(), o


def test_a_budget_nothing_fits_names_the_closest_and_what_would_fit(tmp_path, capsys):
    code = main(["--budget", "1MiB", "--out", str(tmp_path), "packing=none",
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
