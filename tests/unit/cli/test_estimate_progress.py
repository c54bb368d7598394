"""``memlab estimate -m``'s progress (issue 45 item 2): ``hydra/sweeper=progress`` shows a bar
on stderr from the start, while Hydra composes every job's configuration (the silent minute of
a large sweep), then one of the jobs ended, each with its ETA and the lowest peak so far; the
launcher's lines per job are left out and a warning is written above the bars. Here with a
task that estimates nothing (no pipeline: the configurations are only composed); the real
estimate sweep's bar: tests/integration/test_estimate.py::test_sweep_of_estimates_and_their_verdicts.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from memlab.cli.app import run_app


def test_the_bar_counts_composing_then_jobs_from_the_start(tmp_path: Path, capsys) -> None:
    seen: list[tuple[int, str]] = []

    def task(cfg: Any) -> dict[str, Any]:
        from hydra.core.hydra_config import HydraConfig

        num = HydraConfig.get().job.num
        seen.append((num, capsys.readouterr().err))  # what stderr said before this job ran
        if num == 1:
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        return {"status": "ok", "peak_bytes": (10, 5)[num] * 2**20}

    run_app(task, ["-m", "train.lr=0.1,0.2", "hydra/sweeper=progress",
                   "hydra/launcher=basic", f"hydra.sweep.dir={tmp_path}"])
    out = capsys.readouterr()
    assert [num for num, _ in seen] == [0, 1]  # Hydra's numbering, in order
    before_first = seen[0][1]  # before any job ran: every configuration composed, 0 jobs ended
    assert "[memlab] composing" in before_first and "2/2" in before_first
    assert "[memlab] jobs" in before_first and "0/2" in before_first
    err = "".join(e for _, e in seen) + out.err
    warned = next(line for line in err.splitlines() if "a library's warning" in line)
    assert warned.startswith(__file__)  # on a line of its own, above the bar
    assert "lowest peak 5.0 MiB (#1)" in out.err
    last = out.err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("[memlab] jobs: 100%") and "2/2" in last
    assert "Launching" not in out.out + out.err and "#1 :" not in out.out + out.err
    assert (tmp_path / "multirun.yaml").is_file() and (tmp_path / "1" / ".hydra").is_dir()
