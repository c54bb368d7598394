"""memlab fit's measuring loop (issue 45 item 4) with made-up runs: tied or untimed top
candidates are measured again, with twice the steps, until the spreads separate or
--measure-budget would run out; fit.json keeps every run."""

import pytest

from memlab.cli.fit import search
from memlab.cli.fit.search import FitOptions, measure
from memlab.cli.fit.space import Candidate


def _cands(n=3):
    out = []
    for i in range(n):
        c = Candidate([f"train.batch_size={4 >> i}"], f"c{i}", True)
        c.estimate = {"fits": True, "needed_bytes": 1, "predicted_s": 1.0 + i}
        c.predicted_rank = i + 1
        out.append(c)
    return out


@pytest.fixture
def runs(monkeypatch):
    """run_once answering from a table: (label, steps) -> (tokens/s, std, timed steps)."""
    table: dict = {}
    calls: list = []

    def fake(overrides, steps, run_dir):
        label = next(k for k, v in table.items() if k[1] == steps and f"train.batch_size="
                     f"{4 >> int(k[0][1])}" in overrides)
        tps, std, timed = table[label]
        calls.append(label)
        return {"status": "ok", "run_dir": str(run_dir), "peak_bytes": 1, "tokens_per_s": tps,
                "tokens_per_s_std": std, "timed_steps": timed, "wall_s": 10.0 * steps / 6}

    monkeypatch.setattr(search, "run_once", fake)
    return table, calls


def test_a_tie_is_measured_again_until_the_spreads_separate(runs, tmp_path):
    table, calls = runs
    table.update({("c0", 6): (100.0, 8.0, 4), ("c1", 6): (95.0, 6.0, 4),
                  ("c2", 6): (50.0, 1.0, 2),  # not timed: measured again too
                  ("c0", 12): (101.0, 2.0, 10), ("c1", 12): (94.0, 2.0, 10),
                  ("c2", 12): (52.0, 1.0, 8)})
    cands = _cands()
    done = measure([], cands, None, FitOptions(budget_bytes=10, measure=3, steps=6), tmp_path,
                   lambda m: None)
    assert calls == [("c0", 6), ("c1", 6), ("c2", 6), ("c0", 12), ("c1", 12), ("c2", 12)]
    assert [c.run()["timed_steps"] for c in done] == [10, 10, 8]
    assert [e["timed_steps"] for e in done[0].run()["earlier"]] == [4]
    assert search.fastest(done).label == "c0" and search.ties(done[0], done) is None


def test_the_budget_stops_measuring_and_the_tie_is_said(runs, tmp_path):
    table, calls = runs
    table.update({("c0", 6): (100.0, 8.0, 4), ("c1", 6): (95.0, 6.0, 4)})
    cands = _cands(2)
    cands[1].measured = None
    logged: list[str] = []
    done = measure([], cands, None, FitOptions(budget_bytes=10, measure=2, steps=6,
                                               measure_budget_s=30.0), tmp_path, logged.append)
    assert calls == [("c0", 6), ("c1", 6)]  # 20 s spent, 40 more would pass 30
    assert "--measure-budget 30" in logged[-1]
    winner = search.fastest(done)
    assert search.ties(winner, done) == {"with": ["c1" if winner.label == "c0" else "c0"],
                                         "within_pct": 8.0}


def test_a_measured_run_of_a_configuration_with_epochs_is_its_steps(tmp_path):
    """fit measures a configuration that sets train.epochs: its runs set train.steps and clear
    train.epochs (both set is invalid), and the command composes and validates."""
    from memlab.cli.fit.runs import run_command
    from memlab.context import validate
    from memlab_testing import compose

    cmd = run_command(["debug=smoke", "precision=fp32", "train.steps=null", "train.epochs=2"],
                      6, tmp_path / "r")
    overrides = [a for a in cmd[3:] if not a.startswith("hydra.")]
    assert overrides[-3:-1] == ["train.steps=6", "train.epochs=null"]
    cfg = compose(overrides)
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg):
        del cfg["hydra"]
    ctx = validate(OmegaConf.create(OmegaConf.to_container(cfg)))
    assert ctx.train.steps == 6 and ctx.train.epochs is None
