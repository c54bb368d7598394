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


DEEP = [*BASE, "model.num_layers=12"]


def test_a_deep_model_stops_in_its_deeper_build_once_a_visit_extended_to_its_depth_is_past():
    """A 12-layer model is estimated from builds of 3 and 4 layers (memlab.estimate.layers):
    the deeper build stops at the end of a visit whose moments, extended to 12 layers along
    the line from the shallower build's, pass the limit, where neither build's own memory
    does (LineStop); the limit at the need still gives the whole estimate."""
    opts = EstimateOptions(device="cuda", card="rtx4090", count_flops=True)
    whole = estimate_one(DEEP, opts)
    need = whole["verdict"]["needed_bytes"]
    assert any(a.startswith("layers: ") for a in whole["assumptions"])
    hi = estimate_one([*BASE, "model.num_layers=4"], opts)["verdict"]["needed_bytes"]
    assert hi < need  # (the 4-layer build's own need: the old stop's bound)
    assert _same(estimate_one(DEEP, opts, stop_above=need), whole)
    limit = hi + (need - hi) // 2
    part = estimate_one(DEEP, opts, stop_above=limit)
    assert part["status"] == "over_budget", part
    assert limit < part["needed_at_least_bytes"] <= need
