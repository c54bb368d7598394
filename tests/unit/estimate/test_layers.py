"""Deep models estimated from two shallow builds (:mod:`memlab.estimate.layers`): on a tiny
8-layer model the extrapolated estimate is the estimate of every layer, byte for byte (every
category, phase, batch, FLOP count and assumption but the one that says it extrapolated),
across methods (SFT, DPO with a held-out set, GRPO and PPO generating: PPO's value and reward
models have a sequence-classification head) and techniques
(LoRA, checkpointing, packing, the chunked loss, the in-backward step, Adafactor, the CUDA model
with mixed precision, DDP's modelled sharding, activation offload); layers alike in pairs
(checkpointing every second layer) at an even and an odd depth; and where a premise fails
(FSDP2's units, a tracked step 0, a model the measured depths would not be cheaper for) every
layer is built."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from memlab.cli.compose import compose
from memlab.estimate import EstimateOptions, estimate
from memlab.estimate.layers import MIN_DEPTH, _labels, _line

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("no_cpu_bf16")]

TINY = ["model.hidden_size=32", "model.intermediate_size=64", f"model.num_layers={MIN_DEPTH}",
        "model.num_heads=4", "model.num_kv_heads=2", "train.batch_size=2",
        "data.seed=1", "data.median_tokens=40", "data.n_examples=4",
        "train.progress=false"]
ONLINE = ["method.max_prompt_length=16", "method.max_completion_length=5", "method.num_generations=2"]
CASES = {
    "sft lora checkpointing packed chunked": [
        "method.max_length=48", "peft=lora", "train.gradient_checkpointing=true", "packing=bfd",
        "method.loss_impl=chunked", "method.chunk_size=16", "train.grad_accum=2"],
    "dpo held-out": ["method=dpo", "method.max_length=48", "method.max_prompt_length=24", "data.eval=0.5",
                     "train.eval_batch_size=2"],
    "grpo lora": ["method=grpo", *ONLINE, "peft=lora"],
    "ppo": ["method=ppo", *ONLINE],
    "in-backward adafactor": ["method.max_length=48", "optimizer=adafactor", "optimizer.in_backward=true",
                              "train.max_grad_norm=null"],
}
NOTE = "layers: "


SHORT: dict[tuple[str, ...], dict] = {}
"""Overrides -> their two-shallow-build estimate with :data:`FLOPS` in this process (the forked
build's test compares with the one the grpo case made; the file runs on one worker)."""
FLOPS = EstimateOptions(count_flops=True)


def _both(overrides: list[str], opts: EstimateOptions) -> tuple[dict, dict]:
    cfg, choices = compose(overrides)
    out = []
    for every in (True, False):
        est = estimate(cfg, dataclasses.replace(opts, every_layer=every), choices, overrides)
        assert est["status"] == "ok", est["error"]
        est.pop("estimator")
        if not every and opts == FLOPS:
            SHORT[tuple(overrides)] = copy.deepcopy(est)
        est["options"].pop("every_layer")
        out.append(est)
    return out[0], out[1]


@pytest.mark.parametrize("case", list(CASES))
def test_two_shallow_builds_give_the_estimate_of_every_layer(case):
    every, short = _both(TINY + CASES[case], FLOPS)
    notes = [a for a in short["assumptions"] if a.startswith(NOTE)]
    assert len(notes) == 1 and f"{MIN_DEPTH} decoder layers measured at 3 and 4" in notes[0]
    assert not any(a.startswith(NOTE) for a in every["assumptions"])
    short["assumptions"] = [a for a in short["assumptions"] if not a.startswith(NOTE)]
    assert short == every
    assert every["model"]["config"]["num_hidden_layers"] == MIN_DEPTH


@pytest.mark.parametrize("extra", [
    ["precision=bf16_mixed", "distributed=ddp", "distributed.nproc=2",
     "train.gradient_checkpointing=true"],
    ["offload=activations", "train.gradient_checkpointing=true",
     "method.loss_impl=standard"],  # (the chunked loss saves nothing large enough to offload)
])
def test_the_cuda_model_extrapolates_exactly(extra):
    """With DDP's modelled sharding; with activation offload (CUDA only), its host-side
    statistics included."""
    every, short = _both(TINY + ["method.max_length=48", *extra],
                         EstimateOptions(device="cuda", card="a10g", count_flops=True))
    assert any(a.startswith(NOTE) for a in short["assumptions"])
    short["assumptions"] = [a for a in short["assumptions"] if not a.startswith(NOTE)]
    assert short == every
    if "distributed=ddp" in extra:
        assert short["sharding"]["world_size"] == 2 and short["unsharded"] is not None
    else:
        assert short["offload"]["offloaded_bytes"] > 0


def test_the_shallow_build_in_a_forked_process_gives_the_same_estimate():
    """``parallel_builds`` (what ``memlab estimate`` does): the 3-layer build forked while this
    process measures the 4-layer one; GRPO with LoRA (generation, a reference-free policy),
    against the same estimate built in one process (the grpo case's above, or made here when
    this test runs alone)."""
    overrides = TINY + CASES["grpo lora"]
    cfg, choices = compose(overrides)
    if tuple(overrides) not in SHORT:
        _both(overrides, FLOPS)  # (the grpo case's estimates)
    forked = estimate(cfg, FLOPS, choices, overrides, parallel_builds=True)
    assert forked["status"] == "ok", forked["error"]
    forked.pop("estimator")
    assert any(a.startswith(NOTE) for a in forked["assumptions"])
    assert forked == SHORT[tuple(overrides)]


@pytest.mark.parametrize("layers", [12, 13])
def test_layers_alike_in_pairs_extrapolate_exactly(layers):
    """``train.checkpoint_every=2``: the even layers recompute, the odd ones keep their
    activations; measured at 4 and 6 layers for an even depth, 5 and 7 for an odd one."""
    every, short = _both(TINY + [f"model.num_layers={layers}", "method.max_length=48",
                                 "train.gradient_checkpointing=true", "train.checkpoint_every=2",
                                 "peft=lora", "train.grad_accum=2"],
                         EstimateOptions(count_flops=True))
    notes = [a for a in short["assumptions"] if a.startswith(NOTE)]
    measured = "4 and 6" if layers % 2 == 0 else "5 and 7"
    assert len(notes) == 1 and f"{layers} decoder layers measured at {measured} layers (alike " \
        "in pairs" in notes[0]
    short["assumptions"] = [a for a in short["assumptions"] if not a.startswith(NOTE)]
    assert short == every
    assert every["model"]["config"]["num_hidden_layers"] == layers


@pytest.mark.parametrize("extra,opts", [
    (["distributed=fsdp2", "distributed.nproc=2"], EstimateOptions()),  # its own units
    ([], EstimateOptions(run_first_step=True)),  # step 0 makes the state param by param
    (["train.gradient_checkpointing=true", "train.checkpoint_every=2"],  # pairs: 4 + 6 > 8
     EstimateOptions()),
    (["model.num_layers=4"], EstimateOptions()),  # shallower than MIN_DEPTH
])
def test_every_layer_is_built_where_a_premise_fails(extra, opts):
    overrides = [*TINY, "method.max_length=48", *extra]
    cfg, choices = compose(overrides)
    est = estimate(cfg, opts, choices, overrides)
    assert est["status"] == "ok", est["error"]
    assert not any(a.startswith(NOTE) for a in est["assumptions"])
    layers = 4 if "model.num_layers=4" in extra else MIN_DEPTH
    assert est["model"]["config"]["num_hidden_layers"] == layers


def test_labels_name_the_two_first_and_two_last_layers():
    assert [_labels("p", "fw", i, 3) for i in range(3)] == [
        (("p", "fw", 0),), (("p", "fw", 1), ("p", "fw", -2)), (("p", "fw", -1),)]
    assert [len(_labels("p", "bw", i, 4)) for i in range(4)] == [1, 1, 1, 1]
    assert _labels("p", "bw", 4, 9) == (("p", "bw", "mid"),)
    # alike in pairs: three at each end (at 4 layers, the middle two carry two labels each)
    assert [len(_labels("p", "fw", i, 4, 3)) for i in range(4)] == [1, 2, 2, 1]
    assert [len(_labels("p", "fw", i, 6, 3)) for i in range(6)] == [1] * 6
    assert _labels("p", "fw", 3, 12, 3) == (("p", "fw", "mid"),)


def test_a_line_through_two_depths_extends_numbers_and_refuses_disagreements():
    assert _line({"a": 10, "b": [1, "x"], "c": None}, {"a": 13, "b": [2, "x"], "c": None},
                 24) == {"a": 10 + 3 * 21, "b": [1 + 21, "x"], "c": None}
    with pytest.raises(ValueError):
        _line({"a": "x"}, {"a": "y"}, 8)
    with pytest.raises(ValueError):
        _line([1, 2], [1], 8)
