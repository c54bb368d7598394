"""``distributed.master_port`` that another program holds: the run ends ``invalid`` with the
port and its fix (was ``failed`` with torch's socket error), before any rank starts."""

from __future__ import annotations

import socket

from memlab_testing import DDP, run_job


def test_a_master_port_in_use_is_invalid_and_named(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        s = run_job(tmp_path, [*DDP, f"distributed.master_port={port}", "train.steps=1"])
    assert s["status"] == "invalid", s["error"]
    assert f"distributed.master_port={port}: the port is in use" in s["error"]
    assert "or 0" in s["error"]
    assert not (tmp_path / "run" / "ranks" / "rank0.log").exists()  # no rank was started
