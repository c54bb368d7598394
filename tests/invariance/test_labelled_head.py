"""``method.head_on=labelled`` and ``method.padding_mask=auto`` beyond SFT: DPO and KTO (padded,
padding-free, packed rows with shared prompts) and the online methods (GRPO with a KL term and
reused rollouts, RLOO, Online DPO, PPO's policy and value passes; padded, padding-free and
shared-prompt rollouts) give the loss and gradients of the output head on every position
(``head_on=all``) with the padding mask sent (``always``), and, for the online methods, of the
unshared padded rollout: ``method.share_prompt`` (on by default where the attention can) stores
a group's prompt once with the same log-probs. A full model and a LoRA one (LoRA on lm_head too: the head's hook sits on the adapter).
fp32 CPU, real configs, models and attention (memlab's per-document sdpa): loss and gradients
within 1e-5 (online) / 5e-5 (DPO, KTO: :data:`PREFERENCE_TOL`), relative to the loss and to the
largest gradient entry. Negative control: a completion token moved by one
position changes the loss."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from memlab import pipeline
from memlab.generation.base import samples_from
from memlab.method.base import LOSS_INDEX, Batch
from memlab.run import seed_everything, validate
from memlab_testing import FAST, compose

LORA = ["peft=lora", "peft.target_modules=[q_proj,v_proj,lm_head]"]
PREFERENCE_TOL = 5e-5
"""DPO / KTO: differences of sums of ~100 token log-probs times beta (measured up to 1.3e-5 of
the largest gradient entry and 1e-5 relative on a loss of 2); online methods: 1e-5."""


@functools.cache
def _ctx(*overrides: str):
    from omegaconf import OmegaConf, open_dict

    online = any(o in overrides for o in ("method=grpo", "method=rloo", "method=online_dpo",
                                          "method=ppo"))
    fast = [o for o in FAST if not (online and o.startswith("method."))]
    cfg = compose([*fast, "train.batch_size=3", "data.n_examples=10", "data.median_tokens=60",
                   *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    ctx = validate(OmegaConf.to_container(cfg, resolve=True))
    seed_everything(ctx.train.seed)
    return ctx


def _models(ctx, tok) -> dict:
    """The policy (perturbed away from its reference: weights or a non-zero adapter) and the
    method's extra models, built by the pipeline's loader."""
    loader = pipeline.Loader(ctx, tok, pipeline.Seams())
    policy = loader.model(ctx)
    models = {"policy": policy, **ctx.method.extra_models(policy, ctx, loader)}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad and (ctx.peft.name == "none" or "lora_B" in name):
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return models


def _loss_and_grads(method, models, batch, ctx):
    trained = [m for m in models.values() if any(p.requires_grad for p in m.parameters())]
    for m in trained:
        m.zero_grad(set_to_none=True)
    loss, _ = method.loss(models, batch, ctx)
    loss.backward()
    grads = {f"{k}.{n}": p.grad.clone() for k, m in models.items() if m in trained
             for n, p in m.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(a, b, tol: float = 1e-5):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    assert ga.keys() == gb.keys() and ga
    scale = max(float(g.abs().max()) for g in gb.values())
    worst = max(float((ga[n] - g).abs().max()) for n, g in gb.items())
    assert worst <= tol * scale, (worst, scale)


# ------------------------------------------------------------------------------ dpo, kto


def _knobs(ctx, **knobs):
    """``ctx`` with other method knobs (the same run otherwise: no new composition)."""
    return dataclasses.replace(ctx, method=dataclasses.replace(ctx.method, **knobs))


FULL = {"head_on": "all", "padding_mask": "always"}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_preference_labelled_head_is_the_full_head(method, lora):
    """Padded rows (without their mask under sdpa), padding-free rows, and packed rows with
    shared prompts (forks: a prompt's last position scored once per completion)."""
    over = (f"method={method}", "method.max_prompt_length=48", *(LORA if lora else ()))
    plain = _ctx(*over)
    packed = _ctx(*over, "packing=bfd", "method.share_prompt=true", "method.max_length=128")
    tok = plain.model.load_tokenizer(plain)
    models = _models(plain, tok)
    for ctx, flat in ((plain, False), (plain, True), (packed, False)):
        ctx = _knobs(ctx, padding_free=flat)
        full = _knobs(ctx, **FULL)
        ds, _ = pipeline.prepare_data(ctx, tok)
        items = [ds[i] for i in range(1 if ctx.packing.packs else 3)]
        batch = ctx.method.collate(items, tok, ctx)
        ref = full.method.collate(items, tok, full)
        assert LOSS_INDEX in batch.tensors and LOSS_INDEX not in ref.tensors
        if not (flat or ctx.packing.packs):  # sdpa computes the padding anyway: no mask
            assert "attention_mask" not in batch.tensors
            assert bool((ref.tensors["attention_mask"] == 0).any())
        if ctx.packing.packs:
            assert ref.tensors["fork_index"].numel() > 0  # shared prompts' forks are scored
        index = batch.tensors[LOSS_INDEX]
        assert 0 < index.numel() < 0.9 * batch.tensors["input_ids"].numel()
        _assert_same(_loss_and_grads(ctx.method, models, batch, ctx),
                     _loss_and_grads(full.method, models, ref, full), PREFERENCE_TOL)


# ------------------------------------------------------------------------------ online

ONLINE = {  # method -> overrides (GRPO: a KL term to a reference copy and reused rollouts)
    "grpo": ["method=grpo", "method.beta=0.04", "method.num_iterations=2",
             "method.num_generations=3"],
    "rloo": ["method=rloo", "method.beta=0.05", "method.num_generations=3"],
    "online_dpo": ["method=online_dpo"],
    "ppo": ["method=ppo", "method.num_generations=2"],
}
ROLLOUTS = {
    "padded": {"share_prompt": False},
    "padding-free": {"share_prompt": False, "padding_free": True},
    "shared prompt (the default here)": {},
    "shared prompt, padding-free": {"share_prompt": True, "padding_free": True},
}


def rollout(ctx, tok, g: int, seed: int = 0, rewards: list[float] | None = None):
    """A prompt batch (three prompts of different lengths) and ``g`` completions of each
    (different lengths, some ending with EOS) with their rewards, as an engine returns them."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 300, (n,), generator=gen).tolist() for n in (11, 4, 7)]
    batch = ctx.method.collate([{"prompt_ids": p, "reference": "", "prompt_text": ""}
                                for p in prompts], tok, ctx)
    n = len(prompts) * g
    comp = torch.randint(5, 300, (n, 6), generator=gen)
    eos = tok.eos_token_id
    for i, end in zip(range(n), [1, 5, 3, 6, 2, 6, 4, 6, 6], strict=False):
        if end < 6:
            comp[i, end] = eos
    samples = samples_from(comp, eos, tok.pad_token_id)
    r = torch.tensor(rewards if rewards is not None else
                     torch.randn(n, generator=gen).tolist(), dtype=torch.float32)
    return batch, samples, r


def trained(method, models, batch, samples, rewards, ctx, real: bool = True) -> Batch:
    return method.training_batch(models, batch, samples, rewards.clone(), {}, ctx, real)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("method", list(ONLINE))
def test_online_rollouts_are_the_padded_full_head(method, lora):
    """Every rollout layout with the labelled head and no padding mask against the padded
    rollout with the head on every position and the mask: the generation-time values (old
    log-probs, PPO's values and advantages), the loss and the gradients."""
    base = _ctx(*ONLINE[method], *(LORA if lora else ()))
    tok = base.model.load_tokenizer(base)
    models = _models(base, tok)
    full = _knobs(base, **FULL, share_prompt=False)
    g = base.method.num_generations
    batch, samples, rewards = rollout(base, tok, g)
    ref = trained(full.method, models, batch, samples, rewards, full)
    expect = _loss_and_grads(full.method, models, ref, full)
    r = ref.tensors
    assert "attention_mask" in r and r[LOSS_INDEX].numel() == sum(samples.lengths)
    for layout, knobs in ROLLOUTS.items():
        ctx = _knobs(base, **knobs)
        ours = trained(ctx.method, models, batch, samples, rewards, ctx)
        t = ours.tensors
        assert ours.num_items == ref.num_items, layout
        assert "attention_mask" not in t and t[LOSS_INDEX].numel() == sum(samples.lengths)
        torch.testing.assert_close(t["advantages"], r["advantages"], rtol=1e-5, atol=1e-6)
        for k in ("old_logps", "old_values", "token_advantages", "returns"):
            if k in r:  # generation-time values
                torch.testing.assert_close(t[k], r[k], rtol=1e-5, atol=1e-5, msg=k)
        assert ctx.method.shares_prompt(ctx) == ("shared" in layout), layout
        if "shared" in layout:  # each prompt stored once: fewer tokens in the forward
            assert ours.real_tokens == ref.real_tokens - (g - 1) * (11 + 4 + 7), layout
        _assert_same(_loss_and_grads(ctx.method, models, ours, ctx), expect)


def test_online_comparison_would_catch_a_shifted_position():
    """Negative control: the scored positions of a shared-prompt rollout moved one token
    earlier change the loss (Online DPO's depends on the log-probs' values)."""
    ctx = _knobs(_ctx(*ONLINE["online_dpo"]), share_prompt=True)
    tok = ctx.model.load_tokenizer(ctx)
    models = _models(ctx, tok)
    batch, samples, rewards = rollout(ctx, tok, 2)
    ours = trained(ctx.method, models, batch, samples, rewards, ctx)
    good, _ = _loss_and_grads(ctx.method, models, ours, ctx)
    t = dict(ours.tensors)
    t[LOSS_INDEX] = (t[LOSS_INDEX] - 1).clamp(min=0)
    bad, _ = _loss_and_grads(ctx.method, models, dataclasses.replace(ours, tensors=t), ctx)
    assert (bad - good).abs() > 1e-3
