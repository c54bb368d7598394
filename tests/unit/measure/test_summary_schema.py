"""summary.json's typed record (memlab.measure.schema): the shipped JSON Schema is the one the
definition makes; every ending's record, written by the code that writes it (a run, guarded
record, a rank and their merge, the sweep launcher, the fallback writer), conforms; an unknown
key or a wrong type does not; ``memlab report`` names a record that does not, reads the layout
before ``schema_version`` and names a version it cannot read. (The endings that need a real
training run - an ok run, a sweep, a resumed run, fit's runs, each status of a real sweep - are
checked where the main tier produces them: ``memlab_testing.check_record``.)"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memlab.measure import schema
from memlab.measure.outcome import STATUSES, Interrupted, NonFiniteLoss

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[3]


def problems(record: dict[str, Any]) -> list[str]:
    """What memlab's checker finds, after checking that jsonschema agrees that there is a
    problem (or none)."""
    mine = schema.check(record)
    theirs = [e.message for e in jsonschema.Draft202012Validator(
        schema.shipped_schema()).iter_errors(record)]
    assert bool(mine) == bool(theirs), (mine, theirs)
    return mine


def on_disk(path: Path) -> dict[str, Any]:
    record = json.loads(path.read_text())
    assert problems(record) == [], path
    return record


# ------------------------------------------------------------------------- the definition

def test_the_shipped_schema_is_the_one_the_definition_makes():
    assert schema.SCHEMA_PATH.read_text() == schema.schema_text(), (
        "stale: run python scripts/gen_summary_schema.py")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_summary_schema.py"),
                           "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_fixed_key_object_is_closed_and_every_status_has_its_rule():
    s = schema.json_schema()
    objects = [s, *s["$defs"].values()]
    assert all(o["additionalProperties"] is False and o["required"] is not None
               for o in objects)
    assert tuple(s["properties"]["status"]["enum"]) == STATUSES
    assert tuple(schema.BY_STATUS) == STATUSES
    keys = set(s["properties"])
    for rule in schema.BY_STATUS.values():
        assert set(rule.required + rule.not_null + rule.null) <= keys
    assert s["properties"]["schema_version"]["const"] == schema.SCHEMA_VERSION
    assert {"schema_version", "status", "error", "memory"} <= set(s["required"])
    # every key is documented: its docstring is its description (and the docs' text)
    for obj in objects:
        for key, prop in obj["properties"].items():
            assert prop["description"], f"{obj.get('description')}: {key} has no docstring"


def test_the_docs_section_is_generated_from_the_definition():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import docs_reference
    finally:
        sys.path.remove(str(REPO / "scripts"))
    text = docs_reference.render("summary", None, None)
    assert text == schema.reference()
    assert "| `peak_bytes` | int | always |" in text and "### Memory" in text
    assert "<!-- memlab:summary -->" in (REPO / "docs" / "measurement.md").read_text()


# --------------------------------------------------------------------- every ending, written

def _base(run_dir: Path, **extra: Any) -> dict[str, Any]:
    from memlab.run import base_summary

    summary = base_summary(run_dir, {"method": "sft"}, ["train.steps=2"],
                           {"name": "train", "num": None, "sweep_dir": None,
                            "outputs": [str(run_dir.parent)]})
    summary.update(extra)
    return summary


def _measured(summary: dict[str, Any], steps: int = 2) -> None:
    """What a run's execute fills, by the code that fills it (no model, no data)."""
    from memlab.measure.data import DataStats
    from memlab.measure.memory import MemoryProbe
    from memlab.measure.summary import device_info
    from memlab.run import record_training
    from memlab.trainer.result import TrainResult

    summary["config"] = {"train": {"steps": steps}}
    summary["resolved"] = {"precision": "fp32"}
    summary["device"] = device_info("cpu")
    summary["data"] = DataStats(examples=4, rows=4, tokens_in=64).as_dict()
    summary["memory"] = MemoryProbe("cpu", enabled=False).result()
    summary["memory"]["params"] = {"total": 10, "trainable": 10, "bytes": 40}
    summary["memory"]["models"] = {"policy": summary["memory"]["params"]}
    result = TrainResult(steps=steps, losses=[2.0, 1.5][:steps],
                         metrics={"train/lr": 1e-4}, curves={"train/lr": [1e-4] * steps},
                         real_tokens=64, total_tokens=80, timed_tokens=32, timed_seconds=0.5,
                         timed_samples=2, timed_steps=1, timed_rates=[64.0])
    record_training(summary, result, steps)


def _guarded(tmp_path: Path, raise_: BaseException | None, name: str = "run",
             measured: bool = True, out: str = "summary.json", **extra: Any) -> dict[str, Any]:
    from memlab.record import guarded

    run_dir = tmp_path / name
    summary = _base(run_dir, **extra)

    def body(logger_box: list) -> None:
        if measured:
            _measured(summary)
        if raise_ is not None:
            raise raise_

    guarded(body, summary, run_dir / out)
    return summary


def test_a_run_of_each_ending_writes_a_conforming_record(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMLAB_RAISE", raising=False)
    ends: dict[str, BaseException | None] = {
        "ok": None, "oom": RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"),
        "nan": NonFiniteLoss(2, math.nan), "failed": ValueError("a bug"),
        "interrupted": Interrupted(signal.SIGTERM)}
    for status, exc in ends.items():
        s = _guarded(tmp_path, exc, name=status)
        assert s["status"] == status
        record = on_disk(tmp_path / status / "summary.json")
        assert record["schema_version"] == schema.SCHEMA_VERSION
    assert on_disk(tmp_path / "nan" / "summary.json")["train"]["nan_step"] == 2
    # interrupted before anything was measured, as a stop during data preparation leaves it
    _guarded(tmp_path, Interrupted(signal.SIGINT), name="early", measured=False)
    assert on_disk(tmp_path / "early" / "summary.json")["signal"] == "SIGINT"


def test_an_invalid_configuration_writes_a_conforming_record(tmp_path):
    from memlab.run import run

    s = run({"method": {"name": "no_such_method"}}, tmp_path / "run", {"method": "x"}, [],
            print_table=False)
    assert s["status"] == "invalid"
    on_disk(tmp_path / "run" / "summary.json")


def test_a_resumed_run_and_its_checkpoint_errors_conform(tmp_path):
    from memlab.trainer.resume import ResumePlan

    plan = ResumePlan(path=tmp_path / "ckpt", requested="latest", step=2,
                      changed={"train.lr": {"checkpoint": 1e-4, "run": 2e-4}},
                      skipped=[{"checkpoint": "/x/step_000004", "why": "no state"}])
    _guarded(tmp_path, None, resume=plan.as_dict(), checkpoint={"errors": ["disk full"]})
    assert on_disk(tmp_path / "run" / "summary.json")["resume"]["from"] == str(plan.path)


def test_rank_records_and_their_merge_conform(tmp_path, monkeypatch):
    """Each rank's record, then the run's: rank 0's merged with the others' (the run's
    guarded body, as memlab.run runs it), also when a rank was killed before it wrote one."""
    from memlab.distributed.launch import merge
    from memlab.record import guarded

    monkeypatch.delenv("MEMLAB_RAISE", raising=False)
    ranks = tmp_path / "run" / "ranks"
    for r in (0, 1):
        _guarded(tmp_path, None, out=f"ranks/rank{r}.json", rank=r)
        assert on_disk(ranks / f"rank{r}.json")["rank"] == r
    for name, codes in (("summary.json", [0, 0]), ("killed.json", [0, -9])):
        if name == "killed.json":
            (ranks / "rank1.json").unlink()
        summary = _base(tmp_path / "run", config={"train": {}}, resolved={})
        guarded(lambda box, s=summary, c=codes: merge(s, ranks, 2, c), summary,
                tmp_path / "run" / name)
        on_disk(tmp_path / "run" / name)
    assert on_disk(tmp_path / "run" / "summary.json")["throughput"]["note"] == (
        "summed over 2 ranks")
    killed = on_disk(tmp_path / "run" / "killed.json")
    assert (killed["status"], killed["signal"]) == ("killed", "SIGKILL")
    assert killed["distributed"]["ranks"][1] is None


def test_a_summary_written_to_the_fallback_conforms(tmp_path, monkeypatch):
    from memlab.measure.summary import FALLBACK_ENV, fallback_paths

    blocked = tmp_path / "file"
    blocked.write_text("")  # the run dir is under a file: it cannot be made
    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    summary = _guarded(blocked, None)
    where = fallback_paths(blocked / "run" / "summary.json")[0]
    assert summary["status"] == "ok" and where.parent == tmp_path / "fallback"
    assert on_disk(where)["write_error"] == summary["write_error"]


def _launcher_job(tmp_path: Path, num: int, cmd: str):
    from omegaconf import OmegaConf

    from hydra_plugins.memlab_launcher.memlab_launcher import _Job

    config = OmegaConf.create({"hydra": {"job": {"name": "train"},
                                         "runtime": {"choices": {"method": "sft",
                                                                 "hydra/launcher": "memlab"}}}})
    job = _Job(idx=num, overrides=[f"train.seed={num}"], config=config,
               dir=tmp_path / "sweep" / str(num), timeout_s=60.0, env={})
    job.dir.mkdir(parents=True)
    job.proc = subprocess.Popen(["/bin/sh", "-c", cmd])
    job.proc.wait()
    return job


def test_the_sweep_launcher_records_conform(tmp_path):
    """killed, timeout (with what the job recorded itself) and not_run, as the launcher
    writes them for a sweep job."""
    from hydra_plugins.memlab_launcher.memlab_launcher import MemlabLauncher

    launcher, sweep = MemlabLauncher(), tmp_path / "sweep"
    killed = _launcher_job(tmp_path, 0, "kill -9 $$")
    assert launcher._collect(killed, sweep).return_value["status"] == "killed"
    timeout = _launcher_job(tmp_path, 1, "kill -15 $$")
    timeout.stopped_by, timeout.stop_signal = "timeout", "SIGTERM"
    own = _base(timeout.dir, status="interrupted", error="interrupted by SIGTERM",
                signal="SIGTERM")
    _measured(own)
    own["job"] = {**(own.get("job") or {}), "record_id": timeout.record_id}  # the job's own
    (timeout.dir / "summary.json").write_text(json.dumps(own))
    assert launcher._collect(timeout, sweep).return_value["status"] == "timeout"
    not_run = _launcher_job(tmp_path, 2, "true")
    assert launcher._not_run(not_run, sweep, signal.SIGINT).return_value["status"] == "not_run"
    records = [on_disk(sweep / str(i) / "summary.json") for i in range(3)]
    assert [r["status"] for r in records] == ["killed", "timeout", "not_run"]
    assert records[1]["recorded_status"] == "interrupted" and records[1]["train"]["steps"] == 2


# --------------------------------------------------------------------- what does not conform

def _ok(tmp_path: Path) -> dict[str, Any]:
    _guarded(tmp_path, None)
    return on_disk(tmp_path / "run" / "summary.json")


def test_an_unknown_key_or_a_wrong_type_fails(tmp_path):
    good = _ok(tmp_path)
    cases = {
        "the record: unknown key 'memroy'": {**good, "memroy": {}},
        "memory: expected an object or null, got a string": {**good, "memory": "lots"},
        "memory: unknown key 'peak_gib'": {**good, "memory": {**good["memory"], "peak_gib": 1}},
        "memory.peak_bytes: expected an integer, got a string": {
            **good, "memory": {**good["memory"], "peak_bytes": "1"}},
        "memory.by_category.other: expected an integer, got a boolean": {
            **good, "memory": {**good["memory"], "by_category": {"other": True}}},
        "status: \"fine\" is not one of": {**good, "status": "fine"},
        "the record: no key 'run_dir'": {k: v for k, v in good.items() if k != "run_dir"},
        "the record: no key 'config'": {k: v for k, v in good.items() if k != "config"},
        "memory: must not be null": {**good, "memory": None},
        "error: expected null": {**good, "error": "why"},
        "error: must not be null": {**good, "status": "oom"},
        "the record: no key 'signal'": {**good, "status": "interrupted", "error": "stopped"},
        "schema_version: expected 1": {**good, "schema_version": 2},
    }
    for expected, record in cases.items():
        found = problems(record)
        assert any(p.startswith(expected) for p in found), (expected, found)
    # maps take any name: a new category or phase, a method's curve
    fine = {**good, "memory": {**good["memory"], "by_phase": {"rollout": 1}},
            "train": {**good["train"], "curves": {"kl": [0.1, None]}}}
    assert problems(fine) == []
    # a rank's own record holds no config (the launcher's process has it; memlab.rank)
    assert problems({**{k: v for k, v in good.items() if k != "config"}, "rank": 1}) == []


def test_read_takes_the_layout_before_schema_version_and_names_a_newer_one(tmp_path):
    good = _ok(tmp_path)
    old = {k: v for k, v in good.items() if k not in ("schema_version", "resolved", "config")}
    old["memory"] = {k: v for k, v in old["memory"].items() if k != "tracked_step_peaks"}
    old["retired_key"] = 1  # keys an older memlab wrote and this one does not
    assert schema.read(old)["schema_version"] == schema.SCHEMA_VERSION
    with pytest.raises(schema.Unreadable, match="memory: expected an object or null"):
        schema.read({"status": "ok", "memory": "lots"})
    with pytest.raises(schema.Unreadable, match="schema_version 99 is newer than this memlab "
                                                 "reads"):
        schema.read({**good, "schema_version": 99})
    with pytest.raises(schema.Unreadable, match="not a version"):
        schema.read({**good, "schema_version": "1"})
    assert schema.read(good) == good


def test_report_marks_a_nonconforming_summary_corrupt_naming_why(tmp_path):
    from memlab.cli.report import build_table, load_summaries

    good = _ok(tmp_path / "a")
    runs = {"good": good, "lots": {"status": "ok", "memory": "lots"},
            "unknown": {**good, "memroy": 1}, "newer": {**good, "schema_version": 99},
            "old": {k: v for k, v in good.items() if k != "schema_version"}}
    for name, record in runs.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(record))
    got = {Path(s["_dir"]).name: s for s in load_summaries([tmp_path / "runs"])}
    assert {k: s["status"] for k, s in got.items()} == {
        "good": "ok", "lots": "corrupt", "unknown": "corrupt", "newer": "corrupt", "old": "ok"}
    assert "memory: expected an object or null, got a string" in got["lots"]["error"]
    assert "unknown key 'memroy'" in got["unknown"]["error"]
    assert "schema_version 99 is newer than this memlab reads" in got["newer"]["error"]
    assert str(tmp_path / "runs" / "lots" / "summary.json") in got["lots"]["error"]
    assert list(build_table(list(got.values()))["status"]).count("corrupt") == 3
