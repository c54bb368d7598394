"""An estimate stopped over a limit (memlab fit's candidates that cannot fit,
memlab.estimate.modes.Stop): the limit at the need gives the whole estimate, unchanged; below
it the estimate stops with a lower bound of the need; the process estimates alike afterwards."""

import pytest

from memlab.cli.estimate import estimate_one
from memlab.estimate import EstimateOptions

pytestmark = pytest.mark.pipeline

BASE = ["method.max_length=64", "train.gradient_checkpointing=false", "precision=fp32"]


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "estimator"} == {
        k: v for k, v in b.items() if k != "estimator"}


def test_an_estimate_stops_once_its_need_is_past_the_limit():
    opts = EstimateOptions(device="cuda", card="rtx4090", count_flops=True)
    whole = estimate_one(BASE, opts)
    need = whole["verdict"]["needed_bytes"]
    assert _same(estimate_one(BASE, opts, stop_above=need), whole)
    part = estimate_one(BASE, opts, stop_above=need - 1)
    assert part["status"] == "over_budget", part
    assert part["needed_at_least_bytes"] == need  # (at the peak's moment)
    assert _same(estimate_one(BASE, opts), whole)  # nothing of the stopped step is left
