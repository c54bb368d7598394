"""``train.epochs`` (issue 46 item 10): the steps whole passes come to, counted as transformers'
Trainer counts them (a partial last micro-batch and a short last step, no row dropped), and
exclusive with ``train.steps``. The runs that train them: tests/integration/test_epochs.py."""

from __future__ import annotations

import pytest

from memlab.config import TrainConfig, trl_hint
from memlab.trainer.batch import BatchStream
from memlab.trainer.epochs import steps_per_epoch
from memlab_testing import FAST, config_errors


def _errors(overrides: list[str]) -> list[str]:
    return config_errors(overrides, [o for o in FAST if not o.startswith("train.steps=")])


@pytest.mark.parametrize(("rows", "batch", "accum", "iterations", "steps"), [
    (21, 2, 2, 1, 6),   # 11 micro-batches (the last 1 row), 6 steps (the last 1 micro-batch)
    (20, 2, 2, 1, 5),   # whole
    (3, 4, 8, 1, 1),    # fewer rows than one micro-batch: one short step
    (7, 2, 2, 2, 4),    # an online method trains each generation batch num_iterations times
])
def test_a_pass_is_ceil_of_rows_over_a_steps_rows(rows, batch, accum, iterations, steps):
    assert steps_per_epoch(rows, batch, accum, iterations) == steps


class _Rows(list):
    def __getitem__(self, idx):  # the columns of rows ``idx``, as a datasets.Dataset gives them
        return {"row": [list.__getitem__(self, i) for i in idx]}


def test_the_stream_says_where_a_pass_ends():
    stream = BatchStream(_Rows(range(5)), 2, 0, collate=lambda rows: rows)  # type: ignore[arg-type]
    sizes, ends = [], []
    for _ in range(4):
        sizes.append(len(next(stream)))
        ends.append(stream.at_epoch_end())
    assert sizes == [2, 2, 1, 2] and ends == [False, False, True, False]  # a partial last batch


def test_processes_walk_the_passes_of_one_process_with_their_whole_batch():
    """N ranks with batch B take a global batch of N * B rows from the same permutation: their
    passes end where one process's with batch N * B end (so they take its steps), and together
    they see its rows (a last batch of fewer rows than ranks repeats its last row on the idle
    rank)."""
    def ids(rows):
        return [r["row"] for r in rows]

    one = BatchStream(_Rows(range(7)), 4, 0, collate=ids)  # type: ignore[arg-type]
    ranks = [BatchStream(_Rows(range(7)), 2, 0, collate=ids, shard=(r, 2))  # type: ignore[arg-type]
             for r in range(2)]
    for _ in range(4):  # 4 + 3 rows a pass, two passes
        rows = next(one)
        taken = [next(s) for s in ranks]
        assert sorted(x for t in taken for x in t) == sorted(rows)
        assert [s.at_epoch_end() for s in ranks] == [one.at_epoch_end()] * 2


def test_steps_and_epochs_are_exclusive_and_the_default_is_20_steps():
    assert TrainConfig().fixed_steps() == 20
    assert TrainConfig(steps=7).fixed_steps() == 7
    assert TrainConfig(epochs=2).fixed_steps() is None
    assert _errors(["train.epochs=1"]) == []
    errors = _errors(["train.steps=5", "train.epochs=1"])
    assert errors == ["train.steps=5 and train.epochs=1 are both set; they are exclusive: keep "
                      "train.epochs=1 with train.steps=null, or train.steps=5 with "
                      "train.epochs=null"], errors


def test_trls_num_train_epochs_names_train_epochs():
    hint = trl_hint("num_train_epochs", 3)
    assert hint is not None and "memlab's is train.epochs: train.epochs=3" in hint
    assert "exclusive with train.steps" in hint
