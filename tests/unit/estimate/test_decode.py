"""The estimate's shortened decode (:mod:`memlab.estimate.decode`): prefill, the first and the
last decode step, the steps between answered without the model. On tiny models it gives the same
estimate as one fake forward per new token, in every category and phase, with the same FLOPs,
for every online method (GRPO, RLOO, PPO with LoRA; Online DPO, GKD on-policy without), with vLLM's engine category unchanged; and on
the shipped GRPO experiment's real architecture at a shorter completion length."""

from __future__ import annotations

import pytest

from memlab.cli.compose import compose
from memlab.estimate import EstimateOptions, estimate

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("no_cpu_bf16")]

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "train.batch_size=1",
        "data.seed=1", "data.median_tokens=150", "data.n_examples=2", "train.progress=false"]
SHORT = ["method.max_prompt_length=24", "method.max_completion_length=6"]
LORA = ["peft=lora", "method.beta=0.04", "method.reference=adapter_disabled"]
CASES = {
    "grpo lora, vllm colocate": ["method=grpo", *SHORT, *LORA, "generation=vllm",
                                 "generation.kv_cache_space_gib=0.25"],
    "rloo lora": ["method=rloo", *SHORT, "peft=lora"],
    "online_dpo": ["method=online_dpo", *SHORT],
    "ppo lora": ["method=ppo", *SHORT, "peft=lora"],
    "gkd on-policy": ["method=gkd", "method.lmbda=1.0", "method.max_prompt_length=24",
                      "method.max_length=40", "method.max_new_tokens=6"],
}
SAME = ("peak_bytes", "by_category", "by_phase", "by_phase_category", "peak_at", "flops",
        "batch", "generation_engine", "model")


def both(overrides: list[str], opts: EstimateOptions) -> tuple[dict, dict]:
    cfg, choices = compose(overrides)
    out = []
    for every in (True, False):
        est = estimate(cfg, opts, choices, overrides, every_decode_step=every)
        assert est["status"] == "ok", est["error"]
        out.append(est)
    return out[0], out[1]


def assert_same(every: dict, short: dict, skipped_to: int) -> None:
    for key in SAME:
        assert short[key] == every[key], key
    assert "generate" in short["by_phase"]
    assert any(f"decode steps 2 to {skipped_to} of each generate" in a
               for a in short["assumptions"])
    assert not any("decode steps 2 to" in a for a in every["assumptions"])
    assert sorted(set(every["assumptions"])) == sorted(
        a for a in set(short["assumptions"]) if "decode steps 2 to" not in a)


@pytest.mark.parametrize("case", list(CASES))
def test_the_shortened_decode_is_the_step_by_step_estimate(case):
    every, short = both(TINY + CASES[case], EstimateOptions(count_flops=True))
    assert_same(every, short, 4)
    assert short["flops"]["total"] > 0
    if "vllm" in case:
        assert short["generation_engine"]["kv_cache_bytes"] == 2**28
        assert short["by_phase_category"]["generate"]["generation_engine"] > 0


def test_the_shipped_grpo_experiment_at_a_shorter_completion_length():
    """Qwen2.5-1.5B's widths and vocabulary (one layer), LoRA, checkpointing, bf16, on the
    CUDA model of an RTX 4090: 2 prompts x 8 completions of 6 tokens after 32-token prompts."""
    overrides = ["experiment=qwen2.5_1.5b_grpo_lora", "method.max_prompt_length=32",
                 "method.max_completion_length=6", "train.grad_accum=1"]
    opts = EstimateOptions(device="cuda", card="rtx4090", count_flops=True,
                           config_overrides={"num_hidden_layers": 1})
    every, short = both(overrides, opts)
    assert_same(every, short, 4)
    # share_prompt (on where the attention can): a row per prompt, its 8 completions after it
    assert short["batch"]["shapes"]["input_ids"] == [2, 32 + 8 * 6]
