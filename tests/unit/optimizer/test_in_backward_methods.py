"""``optimizer.in_backward=true`` beyond SFT (test_adamw.py runs SFT; tests/cpu_kernels/
test_qlora.py QLoRA): LoRA's adapters, the offline methods (DPO, KTO, reward model), GKD
(sampling on-policy, a teacher beside) and an online method (GRPO, generating its batches) train
exactly as the standard step without clipping: the same loss curve and the same trainable
weights after every step, to 1e-5 (measured: bit-identical, fp32 on CPU); the optimizer phase
holds every gradient in the standard step and none in backward's. No method steps on more than
one backward's gradients, so none is refused. After the optimizer's state is loaded (a resumed
run), each hook still steps its parameter alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memlab.trainer.optim import step_in_backward
from memlab_testing import compose, with_fast
from unit.optimizer.steps import FIXED, Tied, loss_of, max_param_diff

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("no_cpu_bf16")]

COMMON = [*FIXED, "train.steps=2", "train.lr=1e-2", "train.save_every=1", "data.n_examples=8"]
"""Two steps, each saved."""
TRACKED = ("sft_lora", "dpo", "grpo")
"""Cases whose first step runs under the memory tracker (it doubles a tiny step's time): the
adapters alone, a frozen reference beside the policy, a generate phase."""
ONLINE = ["method.rewards=[memlab_testing:reward_low_ids]", "method.max_completion_length=4",
          "method.max_prompt_length=64"]
PAIRS = ["method.max_length=128", "method.max_prompt_length=64"]
CASES = {
    "sft_lora": ["peft=lora"],
    "dpo": ["method=dpo", *PAIRS],
    "kto": ["method=kto", *PAIRS],
    "reward": ["method=reward", "method.max_length=128"],
    "gkd": ["method=gkd", "method.teacher={seed: 1}", "method.max_new_tokens=4", *PAIRS],
    "grpo": ["method=grpo", *ONLINE, "method.num_generations=4"],
}


def _problems(*overrides: str) -> str:
    """steps.problems with FAST's method settings dropped for a method without them."""
    from omegaconf import OmegaConf, open_dict

    from memlab.context import validate
    from memlab.registry import ConfigErrors

    cfg = compose(with_fast(list(overrides)))
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        validate(OmegaConf.to_container(cfg, resolve=True))
    except ConfigErrors as e:
        return "\n".join(e.errors)
    return ""


def _weights(summary: dict, step: int) -> dict[str, torch.Tensor]:
    from memlab.trainer.checkpoint import read_weights, step_dir

    return read_weights(step_dir(Path(summary["run_dir"]), step))


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("case", list(CASES))
def test_in_backward_trains_as_the_standard_step(job, case):
    """Two steps each way (no clipping): the same losses and weights after each step; the
    tracked cases hold every gradient in the standard step's optimizer phase, none in
    backward's, and in no phase as many as the standard step."""
    o = [*COMMON, *CASES[case], f"measure.memory_steps={int(case in TRACKED)}"]
    std, inb = job(o), job([*o, "optimizer.in_backward=true"])
    assert std["status"] == inb["status"] == "ok", (std["error"], inb["error"])
    assert inb["train"]["loss_curve"] == pytest.approx(std["train"]["loss_curve"], abs=1e-5)
    first, last = _weights(std, 1), _weights(std, 2)
    assert _diff(first, last) > 1e-3  # it trained (GRPO's first loss is 0, not its gradient)
    if case == "sft_lora":
        assert first and all("lora_" in k for k in first)  # the adapters alone
    assert _diff(first, _weights(inb, 1)) <= 1e-5
    assert _diff(last, _weights(inb, 2)) <= 1e-5
    assert "train/grad_norm" not in inb["train"]["curves"]
    if case not in TRACKED:
        return
    # the standard step's optimizer phase holds every trainable gradient (fp32), backward's none
    trainable = 4 * sum(m["trainable"] for m in std["memory"]["models"].values())
    g_std = {k: v["gradients"] for k, v in std["memory"]["by_phase_category"].items()}
    g_inb = {k: v["gradients"] for k, v in inb["memory"]["by_phase_category"].items()}
    assert g_std["optimizer"] == trainable and g_inb["optimizer"] == 0, (g_std, g_inb)
    assert max(g_inb.values()) < trainable, g_inb  # at most those backward still produces
    assert inb["memory"]["peak_bytes"] <= std["memory"]["peak_bytes"]


def test_the_other_online_methods_validate_in_backward():
    """RLOO and online DPO (not run above: GRPO's and DPO's steps) validate with in-backward:
    no method steps on more than one backward's gradients, so none is refused (only
    train.grad_accum > 1, clipping, fp16 loss scaling and DDP / DeepSpeed are: test_adamw.py)."""
    for method in ("rloo", "online_dpo"):
        assert _problems(f"method={method}", "optimizer.in_backward=true", *FIXED) == ""


def test_a_loaded_state_still_steps_one_parameter_per_hook():
    """A resumed run loads the optimizer's state after the hooks are set
    (``opt.load_state_dict`` makes new param-group dicts): each hook still steps its parameter
    alone, in its group, and the parameters stay those of the standard step."""
    import copy

    torch.manual_seed(0)
    std = Tied()
    inb = copy.deepcopy(std)
    batches = [torch.randint(0, 48, (3, 9)) for _ in range(3)]
    opt_std = torch.optim.AdamW(std.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(inb.parameters(), lr=1e-2, weight_decay=0.1)
    step_in_backward(opt, list(inb.parameters()))
    sizes: list[int] = []
    step = opt.step

    def counted(*args, **kwargs):
        sizes.append(sum(len(g["params"]) for g in opt.param_groups))
        return step(*args, **kwargs)

    opt.step = counted  # type: ignore[method-assign]
    for i, ids in enumerate(batches):
        if i == 1:  # as a resume does: the state (one step) through load_state_dict
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        loss_of(std, ids).backward()
        opt_std.step()
        opt_std.zero_grad(set_to_none=True)
        loss_of(inb, ids).backward()
    n = len(list(inb.parameters()))
    assert len(sizes) == 3 * n and set(sizes) == {1}, sizes
    assert max_param_diff(std, inb) <= 1e-5
