"""When the sweep launcher forks a job from memlab's fork server (torch, transformers and memlab
imported once) and when it starts ``python -m`` as before: the decision alone, with no server
started (the forked jobs themselves run in every sweep of the main tier: tests/integration/
test_cli.py checks a forked job measures like a lone run, tests/reliability/test_endings.py
stops forked jobs; test_sweep.py's jobs run under ``hydra.launcher.python``, the exec path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hydra_plugins.memlab_launcher.memlab_launcher import MemlabLauncher
from memlab.distributed import starter


@pytest.fixture
def server_started_with(monkeypatch):
    """The fork server as if it had started with ``env`` (nothing is started)."""

    def started(env: dict[str, str], preload: bool = True) -> None:
        monkeypatch.setattr(starter, "_configured", [preload])
        monkeypatch.setattr(starter, "_server_env", dict(env))

    return started


def test_a_job_is_forked_only_where_its_imports_would_read_the_same_environment(
        server_started_with, monkeypatch):
    monkeypatch.setattr(starter, "_configured", [])
    monkeypatch.setattr(starter, "cuda_present", lambda: False)
    here = dict(os.environ)
    assert starter.serves(here)  # not started yet: it would start with this environment
    assert starter.serves({**here, "REL_DIR": "/x", "MEMLAB_RECORD_ID": "ab", "RANK": "1"})
    for name in ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE",
                 "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "PYTHONHASHSEED", "XDG_CACHE_HOME"):
        assert not starter.serves({**here, name: "/elsewhere"}), name
    server_started_with({**here, "HF_HOME": "/server"})
    assert not starter.serves(here)  # the server's transformers read another cache
    assert starter.serves({**here, "HF_HOME": "/server"})
    server_started_with(here, preload=False)  # a CUDA machine's server imports nothing ahead
    assert not starter.serves(here)
    server_started_with(here)
    monkeypatch.setattr(starter, "cuda_present", lambda: True)  # nor is one forked from there
    assert not starter.serves(here)


def test_the_launcher_forks_with_its_own_python_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(starter, "_configured", [])
    monkeypatch.setattr(starter, "cuda_present", lambda: False)
    env = dict(os.environ)
    assert MemlabLauncher()._forks(env)
    assert not MemlabLauncher(fork_server=False)._forks(env)
    assert not MemlabLauncher(python="/opt/wrapper.sh")._forks(env)  # rlimits, another python
    assert not MemlabLauncher()._forks({**env, "HF_HOME": "/job/own/cache"})
    monkeypatch.setattr(starter, "cuda_present", lambda: True)
    assert not MemlabLauncher()._forks(env)


def test_a_job_started_through_its_own_python_is_not_forked(monkeypatch):
    """A job's own ``hydra.launcher.python`` (an experiment file's: a wrapper with limits for
    that job alone) starts that job through it; the sweep's other jobs are still forked."""
    import sys

    from omegaconf import OmegaConf

    monkeypatch.setattr(starter, "_configured", [])
    monkeypatch.setattr(starter, "cuda_present", lambda: False)
    env = dict(os.environ)
    own = OmegaConf.create({"hydra": {"launcher": {"python": "/opt/wrapper.sh"}}})
    plain = OmegaConf.create({"hydra": {"launcher": {"python": None}}})
    launcher = MemlabLauncher()
    python = launcher._job_settings(own)[2]
    assert python == "/opt/wrapper.sh" and not launcher._forks(env, python)
    python = launcher._job_settings(plain)[2]
    assert python == sys.executable and launcher._forks(env, python)
    wrapped = MemlabLauncher(python="/opt/wrapper.sh")  # the sweep's: every job through it
    assert wrapped._job_settings(plain)[2] == "/opt/wrapper.sh"
    assert not wrapped._forks(env, wrapped._job_settings(plain)[2])


def test_a_long_tmpdir_leaves_the_fork_servers_socket_a_short_path(tmp_path):
    """A TMPDIR too long for a Unix socket's path (a test's tmp_path under xdist: "AF_UNIX path
    too long" before, no forked job or rank could start): multiprocessing's dir for the
    server's socket is made under /tmp; a short TMPDIR is used as it is."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from memlab_testing import REPO

    code = ("from memlab.distributed import starter; from multiprocessing import util; "
            "print(starter.socket_dir()); print(util.get_temp_dir())")
    long_dir, short_dir = tmp_path / ("d" * 80), Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    long_dir.mkdir()
    try:
        for tmpdir, parent in ((long_dir, "/tmp"), (short_dir, str(short_dir))):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True, env={**os.environ, "TMPDIR": str(tmpdir),
                                                  "PYTHONPATH": str(REPO / "src")}).stdout.split()
            assert out[0] == out[1], out  # multiprocessing's own, for the process
            assert os.path.dirname(out[0]) == parent and "/pymp-" in out[0], (tmpdir, out)
            assert len(out[0]) + len("/listener-XXXXXXXX") < 108
            assert not os.path.exists(out[0])  # removed at exit, as multiprocessing's own
    finally:
        shutil.rmtree(short_dir, ignore_errors=True)
