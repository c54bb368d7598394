"""memlab's launcher (``memlab.distributed.launch``) on torch's launcher API, with a probe rank
(tests/launch_probe.py) instead of a training job: the standard environment, the rendezvous
through the launcher's own store (a port nobody else can take), per-rank logs and error files."""

import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from memlab.distributed import starter
from memlab.distributed.ddp import DDP
from memlab.distributed.launch import RankFailed, launch


def _ctx(tmp_path, n=2, port=0):
    return SimpleNamespace(world_size=n, run_dir=tmp_path, distributed=DDP(master_port=port))


def _summary(tmp_path):
    return {"config": {}, "choices": {}, "overrides": [], "job": {}, "run_dir": str(tmp_path)}


def test_ranks_meet_through_the_launchers_store(tmp_path):
    summary = _summary(tmp_path)
    launch(_ctx(tmp_path, n=3), summary, worker="launch_probe")
    ranks = tmp_path / "ranks"
    recs = [json.loads((ranks / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["sum"] for r in recs] == [3.0, 3.0, 3.0]  # 0 + 1 + 2: one process group
    for r, rec in enumerate(recs):
        env = rec["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MEMLAB_RANK"]) == (
            str(r), str(r), "3", str(r))
        assert env["TORCHELASTIC_ERROR_FILE"] == str(ranks / f"rank{r}.error.json")
    assert len({rec["env"]["MASTER_PORT"] for rec in recs}) == 1
    assert summary["distributed"]["exit_codes"] == [0, 0, 0]
    assert summary["data"]["tokens_trained"] == 3
    for r in (1, 2):  # ranks >= 1 write their own logs; rank 0 prints to the terminal
        assert f"probe rank {r} stderr" in (ranks / f"rank{r}.log").read_text()
        assert f"probe rank {r} stdout" in (ranks / f"rank{r}.out").read_text()
    assert not (ranks / "rank0.log").exists()
    if not starter.cuda_present():  # forked from the server that imported ahead: nothing a
        # rank builds its model with is imported again in each rank (transformers loads its
        # modules lazily: the package alone would leave modeling_utils, 1.5 s, to every rank)
        for rec in recs:
            loaded = set(rec["loaded_at_start"])
            assert set(starter.PRELOAD) | {"transformers.modeling_utils"} <= loaded


def test_master_port_is_where_the_store_listens(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch(_ctx(tmp_path, port=port), _summary(tmp_path), worker="launch_probe")
    rec = json.loads((tmp_path / "ranks" / "rank1.json").read_text())
    assert rec["env"]["MASTER_PORT"] == str(port)


def test_an_escaping_exception_lands_in_the_ranks_error_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_FAIL", "1")
    with pytest.raises(RankFailed) as e:
        launch(_ctx(tmp_path), _summary(tmp_path), worker="launch_probe")
    assert "rank 1 failed" in str(e.value) and "rank1.log" in str(e.value)
    err = json.loads((tmp_path / "ranks" / "rank1.error.json").read_text())
    assert "probe rank 1 fails on purpose" in json.dumps(err)
    assert "ValueError" in (tmp_path / "ranks" / "rank1.log").read_text()


def test_a_rank_that_stops_responding_is_named_and_not_taken_for_the_cause(tmp_path,
                                                                             monkeypatch):
    """Rank 1 hangs (ignoring SIGTERM), rank 0 ends with its error: after the grace memlab
    stops rank 1 (SIGKILL in the end), and the run's error is rank 0's, with rank 1 named as
    the one that stopped responding (not "killed by someone", which would rank first)."""
    import memlab.distributed.launch as launch_mod

    monkeypatch.setattr(launch_mod, "GRACE_S", 0.5)
    monkeypatch.setattr(launch_mod, "STOP_S", 0.5)
    monkeypatch.setenv("PROBE_HANG", "1")
    with pytest.raises(RankFailed) as e:
        launch(_ctx(tmp_path), _summary(tmp_path), worker="launch_probe")
    assert e.value.status == "failed"
    assert str(e.value).startswith("rank 1 stopped responding (memlab stopped it")
    assert "after rank 0 ended); rank 0 failed: waited for the hung rank" in str(e.value)


def test_ranks_see_the_runs_environment_and_directory_at_each_launch(tmp_path, monkeypatch):
    """The ranks fork from a server started at the first launch: each launch still gives them
    the run's environment and working directory as they are then (a variable set, another
    removed since the server started), and rank 0 writes to the run's own stdout."""
    launch(_ctx(tmp_path / "a"), _summary(tmp_path / "a"), worker="launch_probe")
    monkeypatch.setenv("PROBE_EXTRA", "seen")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.chdir(tmp_path)
    launch(_ctx(tmp_path / "b"), _summary(tmp_path / "b"), worker="launch_probe")
    for r in range(2):
        rec = json.loads((tmp_path / "b" / "ranks" / f"rank{r}.json").read_text())
        assert rec["extra"] == "seen" and rec["tokenizers"] is None
        assert rec["cwd"] == str(tmp_path)


def test_a_script_without_a_main_guard_is_not_run_again_by_its_ranks(tmp_path):
    """The ranks are forks of a server, not re-imports of the run's script: a script that
    launches at module level (no ``if __name__ == "__main__":``) runs once, not once more in
    every rank (multiprocessing's children import the parent's main module by default)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from pathlib import Path\nfrom types import SimpleNamespace\n"
        "from memlab.distributed.ddp import DDP\nfrom memlab.distributed.launch import launch\n"
        f"with open({str(tmp_path / 'ran.txt')!r}, 'a') as f:\n    f.write('ran\\n')\n"
        f"d = Path({str(tmp_path / 'run')!r})\n"
        "launch(SimpleNamespace(world_size=2, run_dir=d, distributed=DDP(master_port=0)),\n"
        "       {'config': {}, 'choices': {}, 'overrides': [], 'job': {}, 'run_dir': str(d)},\n"
        "       worker='launch_probe')\n")
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ran.txt").read_text() == "ran\n"
    assert json.loads((tmp_path / "run" / "ranks" / "rank1.json").read_text())["sum"] == 1.0
