"""``EstimateOptions(count_flops=True)``: the FLOPs of the fake step, counted without touching
the memory it measures (torch's FlopCounterMode would: its module hooks hold outputs)."""

import pytest

from memlab.cli.estimate import estimate_one
from memlab.estimate import EstimateOptions

SMALL = ["method.max_length=256", "train.batch_size=2"]


pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("no_cpu_bf16")]


@pytest.fixture(scope="module")
def estimates():
    runs = {}
    for name, extra in {"off": ["train.gradient_checkpointing=false"],
                        "every2": ["train.checkpoint_every=2"], "every1": []}.items():
        counted = estimate_one([*SMALL, *extra], EstimateOptions(count_flops=True))
        plain = estimate_one([*SMALL, *extra], EstimateOptions())
        runs[name] = (counted, plain)
    return runs


def test_counting_flops_leaves_the_peak_alone(estimates):
    for counted, plain in estimates.values():
        assert counted["status"] == plain["status"] == "ok"
        assert counted["peak_bytes"] == plain["peak_bytes"]
        assert counted["by_phase"] == plain["by_phase"]
        assert plain["flops"] is None


def test_recomputation_shows_in_the_flops(estimates):
    f = {k: v[0]["flops"]["per_step"] for k, v in estimates.items()}
    assert 0 < f["off"] < f["every2"] < f["every1"]
    # a decoder layer's forward is recomputed: well under the whole step's 3 forwards' worth
    assert f["every1"] < 1.34 * f["off"]
    model = estimates["off"][0]["model"]
    cfg = model["config"]
    # the matmul weights (all but the embedding lookup) x tokens x 6 (forward 2, backward 4)
    weights = model["trainable"] - cfg["vocab_size"] * cfg["hidden_size"]
    assert f["off"] == pytest.approx(6 * weights * 2 * 256, rel=0.05)
